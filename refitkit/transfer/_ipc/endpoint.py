"""Endpoints and sockets: where a session's ZMQ socket lives and how it is opened.

An ``endpoint`` is either

- a bare name (letters, digits, ``._-``), mapped to ``ipc://<socket dir>/<name>.sock`` where the
  socket dir is ``$REFITKIT_SOCKET_DIR`` (an absolute path: a relative one is refused), else
  ``$XDG_RUNTIME_DIR/refitkit`` (when absolute), else ``<tmp>/refitkit-<uid>``; it is created with
  mode 0700 and must be owned by us; or
- an explicit ``ipc:///absolute/path.sock`` whose directory already exists (the caller owns its
  permissions).

The socket file is bound inside a fresh 0700 directory, made 0600, and only then linked under the
endpoint's name, so no other user can connect even for a moment (and the process's umask, which
other threads share, is never touched). A leftover socket file of ours from a dead sender is unlinked
before binding; a file a live process still accepts on is refused (two senders would silently
steal each other's receivers), and so is another uid's file or anything that is not a socket.
A sender removes its socket file on close only while the file is still the one it bound: a
successor that bound the same endpoint meanwhile keeps its own.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import tempfile
import time
from collections import OrderedDict, deque
from typing import Any

import zmq

from refitkit.errors import InvalidInput, TransferError
from refitkit.transfer._ipc.liveness import PeerWatch
from refitkit.transfer.protocol import MAX_FRAME_BYTES, encode

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_MAX_UNIX_PATH = 107  # sun_path is 108 bytes including the NUL
RECONNECT_IVL_MS = 5  # a receiver that starts first must not add 100 ms (the ZMQ default) to a sync
# ...but a connection to a sender that is gone (a socket parked for a next session that does not come) must not try
# 200 times a second forever: the interval doubles after each failed try, up to this
RECONNECT_IVL_MAX_MS = 100


def socket_dir() -> str:
    """The private directory (mode 0700, ours) that holds named endpoints' socket files."""
    base = os.environ.get("REFITKIT_SOCKET_DIR")
    if base and not os.path.isabs(base):  # each process would resolve it against its own working directory
        raise InvalidInput(
            f"REFITKIT_SOCKET_DIR={base!r} is a relative path, which every process (sender, receivers) resolves against "
            "its own working directory, so they could miss each other: set it to an absolute path (~ is not expanded)"
        )
    if not base:
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        if runtime and os.path.isabs(runtime):  # the XDG spec: a relative path is invalid, to be ignored
            base = os.path.join(runtime, "refitkit")
        else:
            base = os.path.join(tempfile.gettempdir(), f"refitkit-{os.getuid()}")
    try:
        os.makedirs(base, mode=0o700, exist_ok=True)
        info = os.stat(base)
    except OSError as exc:  # e.g. a parent this uid cannot traverse, or a file in the way
        raise TransferError(
            f"socket dir {base} cannot be made or read by uid {os.getuid()} ({exc.strerror}); "
            "set REFITKIT_SOCKET_DIR to a directory of yours"
        ) from exc
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise TransferError(
            f"socket dir {base} must be owned by uid {os.getuid()} with mode 0700 "
            f"(it is uid {info.st_uid}, mode {oct(stat.S_IMODE(info.st_mode))}); fix it or set REFITKIT_SOCKET_DIR"
        )
    return base


def socket_path(endpoint: str) -> str:
    """The socket file path an endpoint names (see the module docstring)."""
    if not isinstance(endpoint, str):
        raise InvalidInput(f"endpoint must be a str (a name or ipc:///path), got {type(endpoint).__name__}")
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://") :]
        if not os.path.isabs(path) or not os.path.isdir(os.path.dirname(path)):
            raise InvalidInput(f"endpoint {endpoint!r}: need ipc:///absolute/path in an existing directory")
    elif _NAME.match(endpoint):
        path = os.path.join(socket_dir(), f"{endpoint}.sock")
    else:
        raise InvalidInput(f"endpoint {endpoint!r} is neither a name ([A-Za-z0-9._-]{{1,64}}) nor ipc:///path")
    if len(path.encode()) > _MAX_UNIX_PATH:
        raise InvalidInput(f"endpoint {endpoint!r} maps to {path}, longer than a unix socket path may be")
    return path


def _accepting(path: str) -> bool:
    """Whether a live process accepts connections on the unix socket at ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except TimeoutError:
        return True  # a listener with a full backlog is alive, only busy
    finally:
        probe.close()


def _clear_leftover(path: str) -> None:
    """Unlink a dead sender's socket file of ours at ``path``; TransferError for anything else there."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise TransferError(f"endpoint file {path} exists and is not a socket; refusing to replace it")
    if info.st_uid != os.getuid():
        raise TransferError(
            f"endpoint file {path} belongs to uid {info.st_uid}, not to this uid {os.getuid()}; refusing to "
            "replace it: use another endpoint name (or let its owner remove it)"
        )
    try:
        if _accepting(path):
            raise TransferError(f"endpoint {path} is in use by a live sender; use another endpoint name")
        os.unlink(path)  # stale: its sender died without closing
    except FileNotFoundError:
        pass  # its owner removed it meanwhile
    except OSError as exc:
        raise TransferError(
            f"endpoint file {path} is a leftover this process cannot replace ({exc}); use another endpoint name"
        ) from exc


def bind_sender(context: zmq.Context, path: str) -> tuple[zmq.Socket, PeerWatch]:
    """A ROUTER socket bound at ``path`` (file mode 0600 from birth), after clearing a dead sender's leftover, and the
    watch over its connections (made before it binds: it sees every receiver's connection)."""
    _clear_leftover(path)
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished receiver fails instead of vanishing
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # a peer that sends more is disconnected, never buffered
    watch = PeerWatch(sock)
    try:
        _bind_private_then_link(sock, path)
    except Exception as exc:
        watch.close()
        sock.close(linger=0)
        if isinstance(exc, (OSError, zmq.ZMQError)):  # e.g. a read-only directory, or one that takes no files
            raise TransferError(
                f"cannot bind the sender's socket at {path} ({type(exc).__name__}: {exc}); use an endpoint in a "
                "directory this process can write (a name under REFITKIT_SOCKET_DIR, or ipc:///path)"
            ) from exc
        raise
    return sock, watch


def _bind_private_then_link(sock: zmq.Socket, path: str) -> None:
    """Bind inside a fresh 0700 directory next to ``path``, make the file 0600, then hard-link it as ``path``.

    No window in which another user may connect (the directory keeps everyone out until the file is
    0600), and no process-wide umask change that other threads' files would inherit. The link fails
    rather than replace a file that appeared at ``path`` meanwhile. Where the private directory's path
    would be too long for a unix socket, the socket is bound in place and made 0600 right after.
    """
    private = tempfile.mkdtemp(prefix=".rk", dir=os.path.dirname(path))
    staged = os.path.join(private, "s")
    try:
        if len(staged.encode()) > _MAX_UNIX_PATH:
            sock.bind(f"ipc://{path}")
            os.chmod(path, 0o600)
            return
        sock.bind(f"ipc://{staged}")
        os.chmod(staged, 0o600)
        try:
            os.link(staged, path)
        except FileExistsError as exc:
            raise TransferError(
                f"endpoint {path} appeared while this sender bound it; use another endpoint name"
            ) from exc
    finally:
        try:
            os.unlink(staged)  # the listener keeps its inode, now named ``path``
        except FileNotFoundError:
            pass  # bound in place (the long-path case) or never bound
        os.rmdir(private)


def socket_identity(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path`` right after we bound it, to recognise it at close."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino


def remove_socket_file(path: str, identity: tuple[int, int] | None) -> None:
    """Unlink ``path`` if it is still the file we bound (``identity``), never a successor's socket."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if identity is not None and (info.st_dev, info.st_ino) == identity:
        os.unlink(path)


def connect_receiver(context: zmq.Context, path: str) -> tuple[zmq.Socket, PeerWatch]:
    """A DEALER socket connected to ``path`` (frames queue until the sender binds) and the watch over its connection
    (made before it connects: it sees the connection open)."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # a peer that sends more is disconnected, never buffered
    watch = PeerWatch(sock)
    sock.connect(f"ipc://{path}")
    return sock, watch


def close_watched(sock: zmq.Socket, watch: PeerWatch) -> None:
    """Close a socket and its watch (the watch first: it monitors the socket)."""
    watch.close()
    sock.close(linger=0)


def hello_key(peer: bytes, hello: dict[str, Any]) -> tuple[bytes, Any]:
    """Which sync a hello opens: its receiver's connection and the sync's token (a receiver channel says hello once
    per sync, on its one connection)."""
    exchange = hello.get("exchange")
    return peer, exchange if type(exchange) is str else None


class WaitingReceivers:
    """Hellos of receivers that arrived while a session ran: served, in order, by the next sessions.

    A hello is worth serving only while its receiver still waits for the setup, i.e. within the ``timeout_s`` it
    announced; older ones are skipped. A receiver channel waits on one hello at a time: a newer hello on the same
    connection replaces its older one (that sync gave up), and a hello served already (``serve``) is stale (or a
    flood), and dropped.
    """

    def __init__(self, limit: int = 16, served_limit: int = 64) -> None:
        self._queue: deque[tuple[bytes, dict[str, Any], float]] = deque(maxlen=limit)  # peer, hello, arrival
        self._served: OrderedDict[tuple[bytes, Any], None] = OrderedDict()  # the latest sessions' hellos
        self._served_limit = served_limit

    def add(self, peer: bytes, hello: dict[str, Any]) -> None:
        if hello_key(peer, hello) in self._served:
            return
        for index, (queued, _, _) in enumerate(self._queue):
            if queued == peer:  # that receiver's earlier sync gave up: only its newest hello is waited on
                del self._queue[index]
                break
        self._queue.append((peer, hello, time.monotonic()))

    def serve(self, peer: bytes, hello: dict[str, Any]) -> None:
        """This hello is being served by a session: the same hello again is stale."""
        self._served[hello_key(peer, hello)] = None
        while len(self._served) > self._served_limit:
            self._served.popitem(last=False)

    def served(self, peer: bytes, hello: dict[str, Any]) -> bool:
        return hello_key(peer, hello) in self._served

    def take(self) -> tuple[bytes, dict[str, Any]] | None:
        """The oldest hello whose receiver may still be waiting, or None."""
        while self._queue:
            peer, hello, arrived = self._queue.popleft()
            patience = hello.get("timeout_s")
            if self.served(peer, hello):
                continue
            if not isinstance(patience, (int, float)) or time.monotonic() - arrived <= patience:
                return peer, hello
        return None

    def turn_away(self, sock: zmq.Socket, reason: str) -> None:
        """Tell every waiting receiver to give up now (best effort) and forget them."""
        while self._queue:
            peer, hello, _ = self._queue.popleft()
            frame = encode("abort", session="", reason=reason, exchange=hello.get("exchange"))
            try:
                sock.send_multipart([peer, frame], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # that receiver is gone already
