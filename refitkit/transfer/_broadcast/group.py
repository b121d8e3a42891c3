"""The rendezvous, admission and bounded collectives of a broadcast session (see ``broadcast`` for the rules).

One session's group is formed like this, everything under ``refitkit/bcast/`` in the sender's TCPStore:

- ``offer``                     S: the session id, version, world size, bucket half size, backend and a
                                nonce, as msgpack, followed by an HMAC-SHA256 tag under the job's secret
- ``<session>/join/<rank>``     R: HMAC(secret, session, nonce, rank, held) followed by ``held``, the id of the
                                group this receiver kept from its last sync ("" if none); written once
- ``<session>/go`` | ``abort``  S: every join checked (signed ``{session, group, fresh}``: the group this session
                                runs on, kept or to be formed), or why the session was called off
- ``<group>/pg/...``            a group's own rendezvous (a PrefixStore), kept as long as that group is
- ``<session>/status/<rank>``   R: the receiver's outcome (msgpack ``{ok, message}`` + tag; a failure also
                                carries its exception's ``protocol.failure_fields``), posted at the end,
                                or as soon as it fails so that the sender stops at once

The group outlives the session that formed it: a sync whose every receiver says it holds the sender's kept
group runs on it (no new connections); any other sync forms a new one (the old one is dropped), and a failed sync
drops its group on every side, so the next sync always starts from a group all its members hold whole.

The secret itself never enters the store (anyone who reaches the port can list and read its keys).
Every wait polls with a deadline; a wait for a collective also watches the store for the other
side's abort or failure, so a peer that gave up is noticed within one poll, not at the timeout.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import msgpack
import torch

from refitkit.errors import InvalidInput, PeerGone, ProtocolError, TransferTimeout
from refitkit.transfer.protocol import brief

log = logging.getLogger("refitkit.transfer.broadcast")

PREFIX = "refitkit/bcast/"
TAG_BYTES = 32  # HMAC-SHA256
MIN_SECRET_BYTES = 16
STORE_POLL_S = 0.02  # how often a wait for a collective asks the store whether the other side gave up
MAX_OFFER_BYTES = 1 << 16
# The largest bucket half a receiver accepts from an offer (it allocates two): a sender's bucket_bytes is at most
# twice it.
MAX_HALF_BYTES = 64 << 30
BACKENDS = ("gloo", "nccl")
NCCL_WATCHDOG_SLACK_S = 60.0


def parse_rendezvous(rendezvous: object) -> tuple[str, int]:
    """``"tcp://host:port"`` (an ``init_method`` URL) or ``(host, port)`` as (host, port), else InvalidInput."""
    if isinstance(rendezvous, tuple) and len(rendezvous) == 2:
        host, port = rendezvous
    elif isinstance(rendezvous, str) and rendezvous.startswith("tcp://"):
        parts = urlsplit(rendezvous)
        try:
            host, port = parts.hostname, parts.port
        except ValueError:
            host, port = None, None
    else:
        host, port = None, None
    if (
        not isinstance(host, str)
        or not host
        or isinstance(port, bool)
        or not isinstance(port, int)
        or not 0 < port < 65536
    ):
        raise InvalidInput(
            f"rendezvous={rendezvous!r}; need 'tcp://host:port' (an init_method URL) or a (host, port) tuple "
            "of the TCPStore the sender hosts"
        )
    return host, port


def checked_secret(secret: object) -> bytes:
    """The job's shared secret as bytes (at least ``MIN_SECRET_BYTES``), else InvalidInput."""
    raw = secret.encode() if isinstance(secret, str) else secret
    if not isinstance(raw, bytes) or len(raw) < MIN_SECRET_BYTES:
        raise InvalidInput(
            f"secret must be bytes or str of at least {MIN_SECRET_BYTES} bytes (e.g. secrets.token_hex(16), shared "
            f"with every receiver of this job); got a {type(secret).__name__}"
            + (f" of {len(raw)} bytes" if isinstance(raw, bytes) else "")
        )
    return raw


def tag(secret: bytes, *parts: bytes | str | int) -> bytes:
    """HMAC-SHA256 of ``parts``, each length-prefixed so that no two part lists give the same message."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        raw = part if isinstance(part, bytes) else str(part).encode()
        mac.update(len(raw).to_bytes(8, "little") + raw)
    return mac.digest()


def sign(secret: bytes, label: str, fields: dict[str, Any]) -> bytes:
    payload = msgpack.packb(fields, use_bin_type=True)
    return payload + tag(secret, label, payload)


def open_signed(secret: bytes, label: str, raw: bytes, what: str) -> dict[str, Any]:
    """The fields of a signed value, or ProtocolError when it is not one (wrong secret, garbage, tampering)."""
    payload, got = raw[:-TAG_BYTES], raw[-TAG_BYTES:]
    if len(raw) <= TAG_BYTES or not hmac.compare_digest(got, tag(secret, label, payload)):
        raise ProtocolError(
            f"{what} failed the secret check ({len(raw)} bytes): it was not written with this job's secret "
            "(a different job on this rendezvous, a wrong secret, or tampering)"
        )
    try:
        fields = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"{what} is undecodable ({type(exc).__name__})") from exc
    if type(fields) is not dict:
        raise ProtocolError(f"{what} is a {type(fields).__name__}, not a map")
    return fields


def join_value(secret: bytes, session: str, nonce: bytes, rank: int, held: str) -> bytes:
    """A receiver's join: the proof that it knows the secret, then the id of the group it holds ("" if none)."""
    return tag(secret, "join", session, nonce, rank, held) + held.encode()


def read_join(secret: bytes, session: str, nonce: bytes, rank: int, raw: bytes) -> str | None:
    """The group id a join says its receiver holds, or None when the join is not one made with the secret."""
    proof, held = raw[:TAG_BYTES], raw[TAG_BYTES:]
    try:
        text = held.decode()
    except UnicodeDecodeError:
        return None
    if len(held) > 64 or not hmac.compare_digest(proof, tag(secret, "join", session, nonce, rank, text)):
        return None
    return text


def connect_store(host: str, port: int, *, is_master: bool, timeout_s: float) -> Any:
    """The sender's TCPStore (hosted when ``is_master``), or TransferTimeout naming the address and knob."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(
            host,
            port,
            is_master=is_master,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            use_libuv=True,
        )
    except (RuntimeError, OSError) as exc:  # DistNetworkError / DistStoreError are RuntimeErrors
        role = "host" if is_master else "reach"
        raise TransferTimeout(
            f"handshake: could not {role} the broadcast rendezvous tcp://{host}:{port} within timeout_s={timeout_s:g} "
            f"({type(exc).__name__}: {brief(str(exc))}); is the sender up (receivers) / the port free (sender)?"
        ) from exc


def has(store: Any, key: str) -> bool:
    return bool(store.check([PREFIX + key]))


def get(store: Any, key: str) -> bytes:
    return bytes(store.get(PREFIX + key))


def put(store: Any, key: str, value: bytes) -> None:
    store.set(PREFIX + key, value)


def drop(store: Any, *keys: str) -> None:
    """Delete keys, best effort (a store that went away has nothing left to clean)."""
    for key in keys:
        try:
            store.delete_key(PREFIX + key)
        except (RuntimeError, OSError):
            return


def drop_session(store: Any, session: str, known: list[str]) -> None:
    """Delete a finished session's keys (the group's own rendezvous keys included, found by listing), best effort."""
    try:
        prefix = f"{PREFIX}{session}/"
        keys = [key[len(PREFIX) :] for key in store.list_keys() if key.startswith(prefix)]
    except (RuntimeError, OSError, AttributeError):  # a store without list_keys: the keys we know of
        keys = known
    drop(store, *keys)


def wait_until(found: Callable[[], Any], *, deadline: float, on_timeout: Callable[[], Exception]) -> Any:
    """``found()``'s first truthy result, asked with a growing pause (at most ``STORE_POLL_S``) until ``deadline``."""
    pause = 0.001
    while True:
        result = found()
        if result:
            return result
        now = time.monotonic()
        if now >= deadline:
            raise on_timeout()
        time.sleep(min(pause, deadline - now))  # a bounded poll of the store: it has no wait-for-any
        pause = min(pause * 2, STORE_POLL_S)


def form_group(store: Any, group_id: str, rank: int, world: int, backend: str, timeout_s: float) -> Any:
    """A process group of refitkit's own (never the default one): gloo or NCCL over a PrefixStore of ``group_id``."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"{PREFIX}{group_id}/pg/", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if backend == "gloo":
            return dist.ProcessGroupGloo(prefixed, rank, world, timeout)
        options = dist.ProcessGroupNCCL.Options()
        # NCCL's own watchdog takes the process down when its timeout fires: ours (await_work) must come first.
        options._timeout = timeout + datetime.timedelta(seconds=NCCL_WATCHDOG_SLACK_S)
        return dist.ProcessGroupNCCL(prefixed, rank, world, options)
    except (RuntimeError, OSError) as exc:
        raise TransferTimeout(
            f"handshake: forming the {backend} group {group_id} (rank {rank} of {world}) failed or timed out "
            f"after timeout_s={timeout_s:g}: a peer did not arrive ({type(exc).__name__}: {brief(str(exc))})"
        ) from exc


def broadcast(group: Any, tensor: torch.Tensor) -> Any:
    """Start one broadcast from rank 0 over ``group``; returns its Work."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    return group.broadcast([tensor], options)


def await_work(
    work: Any,
    abort_group: Callable[[], None],
    *,
    deadline: float,
    timeout_s: float,
    where: str,
    peer: str,
    store: Any,
    gave_up: Callable[[Any], None],
) -> None:
    """Wait for one collective until ``deadline``, asking ``gave_up(store)`` (which raises) every ``STORE_POLL_S``.

    Why a poll: a collective has no wait that another condition can interrupt, and NCCL's has no
    timeout at all; on the deadline the group is aborted (NCCL: the communicator, which frees the
    stuck kernel; gloo: its pairs) and TransferTimeout names ``where`` (phase and bucket) and ``peer``.
    The group is reached through ``abort_group`` only: a traceback that kept it alive would make its
    owner's thread wait in its destructor (see ``close_group``).
    """
    pause = 0.0001
    next_check = time.monotonic() + STORE_POLL_S
    while not work.is_completed():
        now = time.monotonic()
        if now >= deadline:
            abort_group()
            raise TransferTimeout(
                f"{where}: no progress from {peer} within timeout_s={timeout_s:g}; the group was aborted "
                "(peer dead or stuck? raise timeout_s if it is just slow)"
            )
        if now >= next_check:
            gave_up(store)
            next_check = now + STORE_POLL_S
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 2, 0.005)
    try:
        work.wait()
    except RuntimeError as exc:  # gloo: a pair's connection closed or reset
        abort_group()
        try:
            gave_up(store)  # a peer that reported why it left is named with its own message
        except PeerGone:  # the store went with it (it hosted the store): the broken connection says more
            pass
        raise PeerGone(
            f"{where}: the connection to {peer} broke ({brief(str(exc))}); did it die? Nothing is left to wait "
            f"for within timeout_s={timeout_s:g}"
        ) from exc


def abort(group: Any) -> None:
    """Abort a group's communication (pending collectives fail), best effort."""
    if group is None:
        return
    try:
        group.abort()
    except (RuntimeError, NotImplementedError) as exc:
        log.debug("aborting a broadcast group failed: %s", exc)


def close_group(holder: list[Any], *, failed: bool) -> None:
    """Tear down the session's group held as ``holder[0]`` (the caller keeps no other reference): shut it
    down after success; after a failure abort it and let a thread of its own drop it, because gloo's
    destructor waits for a collective still pending (one a dead or slow peer never matched) until
    the group's own timeout, ``timeout_s``, and the caller must not wait for that. The thread is not a
    daemon: a process that exits meanwhile waits for it (at most ``timeout_s``), since gloo terminates
    a process whose exit interrupts that destructor."""
    group = holder.pop() if holder else None
    if group is None:
        return
    if failed:
        abort(group)
        reaper = threading.Thread(target=_drop, args=([group],), name="refitkit-broadcast-reaper", daemon=False)
        del group
        reaper.start()
        return
    try:
        group.shutdown()
    except (RuntimeError, NotImplementedError) as exc:
        log.debug("shutting a broadcast group down failed: %s", exc)


def _drop(holder: list[Any]) -> None:
    holder.clear()  # the last reference: the destructor runs (and waits, bounded by the group's timeout) here
