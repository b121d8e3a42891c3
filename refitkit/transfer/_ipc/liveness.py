"""Whether a session's peer is still there, told by its connection: the one place that knows.

A peer that dies (SIGKILL included) sends nothing more, but its kernel closes its end of the unix socket at once
and libzmq's I/O thread sees it. ``PeerWatch`` listens to the socket's monitor (``zmq_socket_monitor``) for the
connections the socket accepts (a sender's: one per receiving session) or makes (a receiver's: one), and follows
the one a session's peer is on. Every wait of a session polls it together with the socket, so a peer that died
ends the wait at once with ``PeerGone`` instead of at ``timeout_s``. A sender learns which connection a hello came on from the frame's source descriptor (``ZMQ_SRCFD``); where
libzmq cannot say, that session's peer is not followed and its death is noticed by ``timeout_s`` as before.

A forked child that inherited the peer's socket keeps its connection open after the peer died (fork copies
descriptors: a trainer's DataLoader workers, say). So where the peer says which process it is and shares our PID
namespace, the session follows that process too, by a pidfd (``follow_process``) polled beside the socket: its
exit ends the wait as the connection's end would.

Frames first: ``poll`` reports a frame while one is queued and the peer as gone only once none is left, so a
peer's last words (a receiver's final ACK or error, a sender's abort) are read before its connection's end, and a
receiver that closes its socket after its final ACK is never taken for dead.
"""

from __future__ import annotations

import math
import os
import secrets
import select
import struct
import time
from collections import OrderedDict
from typing import Any

import zmq

from refitkit.errors import PeerGone
from refitkit.transfer._ipc import shm
from refitkit.transfer.common import SessionPhase
from refitkit.transfer.protocol import timeout_error

_UP = zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED
_DOWN = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED  # (closed: also a connection that ended in its handshake)
_EVENTS = _UP | _DOWN
_EVENT = struct.Struct("=hi")  # a monitor event's first frame: the event, then its value (here: the descriptor)
ORIGINS = 64  # connections of hellos remembered (a sender keeps at most 16 hellos waiting)
FRAMES_PER_LOOK = 64  # frames one look of a wait handles at most: a flood of frames cannot hold it past its bound


class PeerWatch:
    """Follows the connection of a session's peer on one socket, from the socket's monitor.

    Made with the socket, before it binds or connects (so no connection goes unseen), and closed before it. A
    session follows one connection (``follow``): the one its peer's hello came on (``note_hello``), or a receiver
    socket's only one; ``poll`` waits for a frame and notices that connection's end, after which ``lost`` is True.
    """

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.peer = "the peer"  # how errors name the followed peer
        self.lost = False  # the followed connection closed, and every frame before its end was read
        # The monitor's events reach us over an inproc pair, sent by libzmq's I/O thread, which blocks once the pair
        # is full while it holds the socket's monitor lock: a socket whose events nobody read for a while (a channel
        # idle between syncs while receivers come and go) would then deadlock the close that stops the monitor. So
        # the pair takes every event (no high-water mark on our side), and every wait and close() drains it.
        address = f"inproc://refitkit-watch-{os.getpid()}-{secrets.token_hex(8)}"
        sock.monitor(address, _EVENTS)
        self._monitor = sock.context.socket(zmq.PAIR)
        self._monitor.setsockopt(zmq.RCVHWM, 0)
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._monitor.connect(address)
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._serial = 0
        self._up: dict[int, int] = {}  # descriptor -> serial number of the connection open on it
        self._closed: set[int] = set()  # descriptors whose last connection closed
        self._origins: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # a hello's identity -> its connection
        self._followed: tuple[int, int] | None = None  # (descriptor, serial)
        self._follow_next = False  # follow the socket's connection once it comes up (a receiver's, not up yet)
        self._pidfd: int | None = None  # the followed peer's process (follow_process), where it can be had

    # -- which connection ------------------------------------------------------------------------

    def note_hello(self, identity: bytes, frame: zmq.Frame) -> None:
        """Remember the connection a hello from ``identity`` (a sender's socket) came on."""
        try:
            fd = frame.get(zmq.SRCFD)
        except (zmq.ZMQError, ValueError):  # a libzmq without it: this peer's death is noticed by timeout_s
            return
        self._drain()
        serial = self._up.get(fd, -1 if fd in self._closed else None)  # -1: closed already
        if serial is None:
            return  # never seen open (events lost): not followed
        self._origins[identity] = (fd, serial)
        self._origins.move_to_end(identity)
        while len(self._origins) > ORIGINS:
            self._origins.popitem(last=False)

    def left(self, identity: bytes) -> bool:
        """Whether the connection a hello from ``identity`` came on has closed since: its receiver is gone."""
        self._drain()
        origin = self._origins.get(identity)
        return origin is not None and self._up.get(origin[0]) != origin[1]

    def follow(self, identity: bytes | None, peer: str) -> None:
        """For the session starting now: follow the connection of the hello from ``identity``, or (None) this
        socket's only connection, open now or once it opens (a receiver's). ``peer`` names it in errors."""
        self._drain()
        self.peer, self.lost = peer, False
        if identity is not None:
            self._followed, self._follow_next = self._origins.get(identity), False
        else:
            self._followed = next(iter(self._up.items()), None)
            self._follow_next = self._followed is None

    def follow_process(self, pid: Any, pidns: Any) -> None:
        """For the session starting now: also follow the peer's process ``pid`` (as its hello or setup says), by a
        pidfd, where it shares our PID namespace (``pidns``: the peer's ``shm.pid_namespace()``); otherwise, or where
        no pidfd can be had (gone already, or Linux < 5.3), the connection alone tells. The pid was the peer's a
        moment ago (its frame just came over a live connection), so reuse of a dead peer's pid is not a concern."""
        self._drop_process()
        if type(pid) is not int or pid <= 0 or pidns is None or pidns != shm.pid_namespace():
            return
        if not hasattr(os, "pidfd_open"):
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # gone already (its connection's end tells), or not ours to watch
            return
        self._pidfd = fd
        self._poller.register(fd, zmq.POLLIN)

    def unfollow(self) -> None:
        """The session ended: nothing is followed until the next one."""
        self._followed, self._follow_next, self.lost = None, False, False
        self._drop_process()

    def _drop_process(self) -> None:
        fd, self._pidfd = self._pidfd, None
        if fd is not None:
            self._poller.unregister(fd)
            os.close(fd)

    # -- waiting ---------------------------------------------------------------------------------

    def poll(self, timeout_ms: int) -> bool:
        """Up to ``timeout_ms`` for a frame on the socket: True once one is queued. False at the timeout, or at once
        when the followed connection has closed and no frame is left (``lost`` is then True)."""
        sock = self.sock
        if sock.get(zmq.EVENTS) & zmq.POLLIN:
            return True
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            self._drain()
            if self._down():
                # The peer's frames were queued before its connection's end: read them all first.
                if sock.get(zmq.EVENTS) & zmq.POLLIN:
                    return True
                self.lost = True
                return False
            left_ms = math.ceil((deadline - time.monotonic()) * 1000)  # (truncated, a last 0.9 ms would spin)
            if left_ms <= 0:
                return False
            if sock in dict(self._poller.poll(left_ms)):
                return True

    def gone(self, phase: SessionPhase, waiting_for: str) -> PeerGone:
        """The error of a wait that ``lost`` ended: the phase, the followed peer and what was awaited."""
        return PeerGone(
            f"{phase.value}: {self.peer} is gone (its connection closed: it died or closed its socket) while "
            f"waiting for {waiting_for}"
        )

    def _down(self) -> bool:
        followed = self._followed
        if followed is not None and self._up.get(followed[0]) != followed[1]:
            return True
        # the followed process exited (its pidfd is readable), even if a forked child holds its connection open
        return self._pidfd is not None and bool(select.select([self._pidfd], [], [], 0)[0])

    def _drain(self) -> None:
        """Take every monitor event queued (never waits)."""
        monitor = self._monitor
        while monitor.get(zmq.EVENTS) & zmq.POLLIN:
            header = monitor.recv_multipart()[0]
            event, fd = _EVENT.unpack_from(header)
            if event & _UP:
                self._serial += 1
                self._up[fd] = self._serial
                self._closed.discard(fd)
                if self._follow_next:
                    self._followed, self._follow_next = (fd, self._serial), False
            elif event & _DOWN:
                self._up.pop(fd, None)
                self._closed.add(fd)

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop monitoring (before the socket is closed); idempotent."""
        if self._monitor.closed:
            return
        self._drop_process()
        self._drain()  # (what is queued goes first: nothing the I/O thread sends may wait on us)
        if not self.sock.closed:
            self.sock.disable_monitor()
        self._monitor.close(linger=0)


def recv_frame(
    watch: PeerWatch,
    *,
    timeout_s: float,
    phase: SessionPhase,
    waiting_for: str,
    peer: str,
    copy: bool = True,
) -> list[bytes] | list[zmq.Frame]:
    """Receive one multipart message on ``watch``'s socket within ``timeout_s``, else TransferTimeout naming phase and
    knob; PeerGone at once when the followed peer is gone."""
    sock = watch.sock
    deadline = time.monotonic() + timeout_s
    while True:
        if watch.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            return sock.recv_multipart(copy=copy)
        if watch.lost:
            raise watch.gone(phase, waiting_for)
        if time.monotonic() >= deadline:
            raise timeout_error(phase, waiting_for, peer, timeout_s)
