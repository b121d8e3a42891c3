"""Weights to engines on other GPUs or nodes: a torch.distributed broadcast over a group of the sync's own.

``BroadcastWeightSender`` hosts a TCPStore at the rendezvous the user gives (``tcp://host:port``) and
each ``send(weights, version=...)`` is one session: it offers the session in the store, admits
exactly ``receivers`` receivers (ranks 1..N, each proving it knows the job's secret), runs on a
process group of its own with them (gloo on CPU, NCCL on GPU; never the trainer's or the engine's
default group) and broadcasts the stream bucket by bucket, packing the next bucket into the other
half of its buffer while the current one is on the wire. Each bucket is three broadcasts: a header
(metadata and data sizes), the metadata (msgpack, ``protocol``'s ``bucket`` frame: names, dtypes,
shapes, offsets, no pickle) and the bucket's bytes (with ``per_tensor=True``, one broadcast per tensor or
piece instead, so that a receiver with a load plan lands each one in its own memory; see
``BroadcastWeightReceiver.receive(direct=...)``). At the end every receiver posts its outcome;
``send()`` returns once all did, raises ``TransferError`` carrying a receiver's own message if one
failed, ``TransferTimeout`` naming the phase, bucket and peer if a wait ran past ``timeout_s`` (the
group is aborted: for NCCL that is the only way out of a stuck collective), and ``PeerGone`` (a
``TransferTimeout``) when a receiver's connection broke.

The sender and each receiver are the two ends of a channel: the group is formed by the first session and kept
by both sides for the next ones (each sync is then one exchange on connections already made: no rendezvous,
no new sockets or NCCL communicator), as long as every receiver of a session says it holds that same group.
A receiver that is new (or closed and opened again) makes the session form a new group, the old one dropped. A
failed session drops its group on every side, so the next session forms a fresh one that every member holds
whole: a failure ends that sync, never the next. ``close()`` (or leaving ``with``) drops the group and stops
the rendezvous; a receiver's next call then fails with ``PeerGone`` naming the sender.

Security (what the secret buys, and what it does not):

- The secret (``secret=``, at least 16 bytes, one per job, given to the sender and every receiver
  out of band) never travels: the offer and each go / abort / status are HMAC-SHA256-signed and a
  receiver's join is an HMAC of the session's nonce and its rank. A peer without the secret cannot
  verify an offer or forge a join: the sender refuses the session (``ProtocolError`` naming the rank)
  before any weight byte is sent, so it gets nothing, and every other party ends within ``timeout_s``.
- The TCPStore is not authenticated: anyone who reaches its port can read, write and delete keys
  (not the secret, and no weights: those travel on the group's own connections). Such an attacker
  can call a session off or stall it (denial of service, always ended by ``timeout_s``), replay an
  old offer, or take a rank's slot first; it cannot make a receiver load bytes it did not sign.
- The group's data connections are plain TCP (gloo) or NCCL's transports, neither encrypted nor
  authenticated: an eavesdropper on the network path can read the weights, and one who can inject
  packets into an established connection can corrupt them. Run the broadcast on a private network
  (or a VPN / IPsec link) when the weights or the sampling they drive must be protected.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from refitkit.errors import ChannelClosed, InvalidInput, ProtocolError, TransferError, TransferTimeout
from refitkit.transfer._broadcast import group as grp
from refitkit.transfer.common import SessionPhase, TransferStats, checked_device, checked_knobs, checked_version
from refitkit.transfer.packing import BucketPacker, CheckedItem, check_item, check_items, half_bytes_for
from refitkit.transfer.protocol import ALIGN_BYTES, SUPPORTED_DTYPES, brief, encode, remote_failure

log = logging.getLogger("refitkit.transfer.broadcast")
_END = object()  # the end of a generator of weights


def checked_backend(backend: object, device: torch.device) -> str:
    if backend not in grp.BACKENDS:
        raise InvalidInput(f"backend={backend!r}; expected one of {grp.BACKENDS}")
    if backend == "nccl" and device.type != "cuda":
        raise InvalidInput(f"backend='nccl' needs device='cuda' (got {device}); use backend='gloo' on the CPU")
    return backend  # type: ignore[return-value]


class BroadcastWeightSender:
    """The trainer's sending rank of a broadcast sync (rank 0 of each session's group); see the module docstring."""

    def __init__(
        self,
        rendezvous: str | tuple[str, int],
        *,
        secret: bytes | str,
        receivers: int,
        bucket_bytes: int = 512 << 20,
        device: str | torch.device = "cpu",
        backend: str = "gloo",
        timeout_s: float = 120.0,
        per_tensor: bool = False,
    ) -> None:
        self.timeout_s, size, _ = checked_knobs(
            timeout_s=timeout_s,
            bucket_bytes=bucket_bytes,
            min_bucket_bytes=4 * ALIGN_BYTES,
            max_bucket_bytes=(
                2 * grp.MAX_HALF_BYTES,
                "128 GiB: receivers allocate the whole bucket and refuse a larger one",
            ),
        )
        self.half_bytes = (size or 0) // 2 // ALIGN_BYTES * ALIGN_BYTES
        self._secret = grp.checked_secret(secret)
        if isinstance(receivers, bool) or not isinstance(receivers, int) or receivers < 1:
            raise InvalidInput(
                f"receivers={receivers!r}; need an int >= 1 (the engine workers that join every session)"
            )
        self.receivers = receivers
        self.device = checked_device(device)
        self.backend = checked_backend(backend, self.device)
        if not isinstance(per_tensor, bool):
            raise InvalidInput(f"per_tensor={per_tensor!r}; need a bool")
        # One broadcast per tensor (piece) instead of one per bucket: a receiver with a load plan then lands each
        # planned tensor straight in its parameter memory (BroadcastWeightReceiver.receive(direct=...)).
        self.per_tensor = per_tensor
        self.host, self.port = grp.parse_rendezvous(rendezvous)
        self._store: Any = grp.connect_store(self.host, self.port, is_master=True, timeout_s=self.timeout_s)
        self._lock = threading.Lock()
        self._stale: tuple[str, list[str]] | None = None  # the last session and its keys, dropped when the next starts
        self._group: Any = None  # the group the last session ran on and ended well: the next one's, if all hold it
        self.group_id: str | None = None  # its id (None: no group kept)
        self.groups_formed = 0  # how many groups this sender formed (one per channel while no sync fails)
        self.last_timings_s: dict[str, float] = {}

    def close(self) -> None:
        """Drop the kept group and stop hosting the rendezvous; idempotent. The sender cannot send afterwards
        (``ChannelClosed``); a receiver's next call fails with ``PeerGone`` naming the sender."""
        if self._store is None:
            return
        if not self._lock.acquire(timeout=self.timeout_s):
            raise TransferError(
                f"broadcast sender on tcp://{self.host}:{self.port}: close() waited timeout_s={self.timeout_s:g} for "
                "the send() running in another thread"
            )
        try:
            self._drop_group(failed=False)
            self._store = None
        finally:
            self._lock.release()

    def _drop_group(self, *, failed: bool) -> None:
        """Tear the kept group down (its rendezvous keys too); the next session forms a new one."""
        holder, self._group = [self._group], None
        group_id, self.group_id = self.group_id, None
        grp.close_group(holder, failed=failed)
        if group_id is not None and self._store is not None:
            grp.drop_session(self._store, group_id, [])

    def __enter__(self) -> BroadcastWeightSender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def send(self, weights: Any, *, version: int) -> TransferStats:
        """Broadcast every (name, tensor) of ``weights`` as weight version ``version``; returns once every
        receiver reported that it loaded the whole stream. A list or tuple is checked whole first."""
        number = checked_version(version)
        if isinstance(weights, (list, tuple)):
            listed, _ = check_items(weights, need_cuda=False)
            items = iter(listed)
            pull: Callable[[], CheckedItem | None] = lambda: next(items, None)  # noqa: E731
        else:
            try:
                iterator = iter(weights)
            except TypeError as exc:
                raise InvalidInput(f"weights is a {type(weights).__name__}, not an iterable of (name, tensor)") from exc
            listed, seen = None, set()
            counter = iter(range(1 << 62))

            def pull() -> CheckedItem | None:
                item = next(iterator, _END)
                return None if item is _END else check_item(next(counter), item, seen, need_cuda=False)

        if self._store is None:
            raise ChannelClosed(f"broadcast sender on tcp://{self.host}:{self.port} is closed; make a new one")
        if not self._lock.acquire(timeout=self.timeout_s):
            raise TransferError(
                f"another send() held the broadcast sender for timeout_s={self.timeout_s:g}; one session at a time"
            )
        try:
            if self._stale is not None:  # kept until now: a receiver may still be reading the abort
                grp.drop_session(self._store, *self._stale)
            run = _BroadcastSend(
                pull,
                listed,
                number,
                store=self._store,
                secret=self._secret,
                timeout_s=self.timeout_s,
                receivers=self.receivers,
                half_bytes=self.half_bytes,
                backend=self.backend,
                device=self.device,
                per_tensor=self.per_tensor,
                kept=(self.group_id, self._group),
            )
            self._group = None  # the session holds it now, and hands it back only if it ends well
            self.last_timings_s = run.timings
            try:
                stats = run.run()
            except BaseException:
                self.group_id = None  # (its group was dropped by the session, with its keys)
                raise
            finally:
                self._stale = run.session, run.keys
                self.groups_formed += run.formed
            self.group_id, self._group = run.take_group()
            return stats
        finally:
            self._lock.release()


class _BroadcastSend:
    """One session of the sender: admission, the group, the packer and what is still on the wire."""

    def __init__(
        self,
        pull: Callable[[], CheckedItem | None],
        listed: list | None,
        version: int,
        *,
        store: Any,
        secret: bytes,
        timeout_s: float,
        receivers: int,
        half_bytes: int,
        backend: str,
        device: torch.device,
        per_tensor: bool,
        kept: tuple[str | None, Any],
    ) -> None:
        self.pull, self.version = pull, version
        self.store, self.secret, self.timeout_s = store, secret, timeout_s
        self.backend, self.device, self.per_tensor = backend, device, per_tensor
        self.timings: dict[str, float] = {}  # seconds per phase (the sender's last_timings_s)
        self.session = secrets.token_hex(8)
        self.nonce = secrets.token_bytes(16)
        self.world = receivers + 1
        self.half_bytes = max(ALIGN_BYTES, half_bytes_for(listed, half_bytes))
        self.batch = listed is not None
        self.keys = [f"{self.session}/{key}" for key in ("go", "abort", "failures")]
        self.keys += [f"{self.session}/{kind}/{rank}" for kind in ("join", "status") for rank in range(1, self.world)]
        self.group_id, self.group = kept  # the sender's kept group, if any: this session runs on it if all hold it
        self.formed = 0  # 1 if this session formed its group
        self.packer: BucketPacker | None = None
        self.inflight: dict[int, list[Any]] = {}  # half -> [bucket number, works and the tensors they read]
        self.seq = 0
        self.phase = SessionPhase.HANDSHAKE
        self.peers = f"receiver ranks 1-{self.world - 1}" if self.world > 2 else "receiver rank 1"

    def run(self) -> TransferStats:
        start = time.perf_counter()
        failed = True
        try:
            grp.put(
                self.store,
                "offer",
                grp.sign(
                    self.secret,
                    "offer",
                    {
                        "session": self.session,
                        "version": self.version,
                        "world": self.world,
                        "half_bytes": self.half_bytes,
                        "backend": self.backend,
                        "nonce": self.nonce,
                        "per_tensor": self.per_tensor,
                    },
                ),
            )
            held = self._admit()
            fresh = self.group is None or any(group_id != self.group_id for group_id in held)
            if fresh:  # not every receiver holds the kept group: a new one, the old one dropped
                self._drop_group(failed=True)  # (aborted: a member that is gone must not hold up its shutdown)
                self.group_id = f"g{secrets.token_hex(8)}"
            grp.put(
                self.store,
                f"{self.session}/go",
                grp.sign(self.secret, "go", {"session": self.session, "group": self.group_id, "fresh": fresh}),
            )
            if fresh:
                began = time.perf_counter()
                self.group = grp.form_group(self.store, self.group_id, 0, self.world, self.backend, self.timeout_s)
                self.formed = 1
                self.timings["group"] = time.perf_counter() - began
            self.phase = SessionPhase.STREAMING
            total, count = self._stream()
            self.phase = SessionPhase.DRAINING
            began = time.perf_counter()
            self._await_statuses()
            ack_wait_s = time.perf_counter() - began
            failed = False
            return TransferStats(
                bytes=total, tensors=count, buckets=self.seq, seconds=time.perf_counter() - start, ack_wait_s=ack_wait_s
            )
        except BaseException as exc:
            self._call_off(exc)
            raise
        finally:
            grp.drop(self.store, "offer")  # a receiver arriving now must not join a finished session
            self.inflight.clear()
            if self.packer is not None:
                self.packer.detach()
                self.packer = None  # (it calls back into this session: no cycle may keep the store alive past close())
            if failed:  # its group may be out of step or broken: every side drops it
                self._drop_group(failed=True)

    def _drop_group(self, *, failed: bool) -> None:
        holder, self.group = [self.group], None
        group_id, self.group_id = self.group_id, None
        grp.close_group(holder, failed=failed)
        if group_id is not None:
            grp.drop_session(self.store, group_id, [])

    def take_group(self) -> tuple[str | None, Any]:
        """The group of a session that ended well, and its id, for the sender to keep (the session forgets them)."""
        group, self.group = self.group, None
        return self.group_id, group

    # -- admission --------------------------------------------------------------------------------

    def _admit(self) -> list[str]:
        """Every rank's join present and proven; the group id each says it holds. ProtocolError naming a rank that
        failed the check."""
        joins = [f"{self.session}/join/{rank}" for rank in range(1, self.world)]

        def missing() -> str:
            absent = [str(rank) for rank, key in enumerate(joins, 1) if not grp.has(self.store, key)]
            return (
                f"handshake: receiver rank(s) {', '.join(absent)} did not join session {self.session} (version "
                f"{self.version}) within timeout_s={self.timeout_s:g}; is every engine worker calling receive()? "
                "(raise timeout_s if one is only slow)"
            )

        grp.wait_until(
            lambda: all(grp.has(self.store, key) for key in joins),
            deadline=time.monotonic() + self.timeout_s,
            on_timeout=lambda: TransferTimeout(missing()),
        )
        held = []
        for rank, key in enumerate(joins, 1):
            group_id = grp.read_join(self.secret, self.session, self.nonce, rank, grp.get(self.store, key))
            if group_id is None:
                raise ProtocolError(
                    f"handshake: receiver rank {rank}'s join failed the secret check (a wrong secret, another job on "
                    f"this rendezvous, or an intruder); session {self.session} was called off before any weight was sent"
                )
            held.append(group_id)
        return held

    def _call_off(self, exc: BaseException) -> None:
        """Tell every receiver the session is off (signed), so none waits its timeout for nothing."""
        if self.group is not None:
            grp.abort(self.group)  # pending broadcasts fail now instead of at their timeout
        try:
            reason = f"{type(exc).__name__}: {exc}"[:4000]
            grp.put(
                self.store,
                f"{self.session}/abort",
                grp.sign(self.secret, "abort", {"session": self.session, "reason": reason}),
            )
        except (RuntimeError, OSError) as late:
            log.warning("broadcast session %s: could not post its abort: %s", self.session, late)

    # -- streaming --------------------------------------------------------------------------------

    def _stream(self) -> tuple[int, int]:
        try:
            buffer = torch.empty(2 * self.half_bytes, dtype=torch.uint8, device=self.device)
        except RuntimeError as exc:  # out of memory: name what could not be had, and the knob
            raise TransferError(
                f"streaming: cannot allocate session {self.session}'s bucket of {2 * self.half_bytes} bytes on "
                f"{self.device} ({type(exc).__name__}: {brief(str(exc))}); pass a smaller bucket_bytes"
            ) from exc
        self.packer = BucketPacker(
            buffer, self.half_bytes, send_bucket=self._ship, wait_free=self._wait_free, batch=self.batch
        )
        del buffer  # the packer holds it; detach() frees it at the end
        total = count = 0
        item = self.pull()
        while item is not None:
            self.packer.pack(*item)
            total += item[1].nbytes
            count += 1
            item = self.pull()
        self.packer.finish()
        self._wait_free(0b11)
        return total, count

    def _ship(self, half: int, wide: bool, entries: list[Any], last: bool) -> None:
        """Start the three broadcasts of one bucket (header, metadata, bytes); the packer goes on packing."""
        packer = self.packer
        if packer is None:
            raise TransferError("broadcast sender: a bucket shipped without a packer (a bug in refitkit)")
        used, start = packer.used, packer.bucket_start
        frame = encode(
            "bucket", session=self.session, seq=self.seq, half=half, wide=wide, last=last, entries=entries, nbytes=used
        )
        wire = torch.device("cpu") if self.backend == "gloo" else self.device
        header = torch.tensor([len(frame), used], dtype=torch.int64).to(wire)
        meta = torch.frombuffer(bytearray(frame), dtype=torch.uint8).to(wire)
        pending: list[Any] = [self.seq, header, meta]  # the bucket's number, then what its works read
        pending.append(grp.broadcast(self.group, header))
        pending.append(grp.broadcast(self.group, meta))
        if used:
            data = packer._typed_buffer(torch.uint8)[start : start + used]
            # per tensor: the receivers cut the bytes the same way (entries_from_wire)
            ranges = _piece_ranges(entries) if self.per_tensor else [(0, used)]
            for offset, nbytes in ranges:
                piece = data[offset : offset + nbytes]
                pending += [piece, grp.broadcast(self.group, piece)]
        self.inflight[half] = pending
        if wide:
            self.inflight[1] = pending
        self.seq += 1

    def _wait_free(self, halves: int) -> None:
        for half in (0, 1):
            if halves & (1 << half) and half in self.inflight:
                pending = self.inflight.pop(half)
                if self.inflight.get(half ^ 1) is pending:  # a wide bucket occupies both halves
                    self.inflight.pop(half ^ 1)
                seq = pending[0]
                for work in pending[1:]:
                    if not isinstance(work, torch.Tensor):
                        grp.await_work(
                            work,
                            lambda: grp.abort(self.group),
                            deadline=time.monotonic() + self.timeout_s,
                            timeout_s=self.timeout_s,
                            where=f"{self.phase.value}: bucket {seq} of session {self.session}",
                            peer=self.peers,
                            store=self.store,
                            gave_up=self._receiver_failed,
                        )

    # -- outcome ----------------------------------------------------------------------------------

    def _receiver_failed(self, store: Any) -> None:
        """Raise TransferError with a receiver's own message if one posted a failure."""
        if not grp.has(store, f"{self.session}/failures"):
            return
        for rank in range(1, self.world):
            key = f"{self.session}/status/{rank}"
            if grp.has(store, key):
                status = grp.open_signed(self.secret, "status", grp.get(store, key), f"receiver rank {rank}'s status")
                if status.get("ok") is not True:
                    _raise_reported(
                        f"{self.phase.value}: receiver rank {rank} failed in session {self.session} (version "
                        f"{self.version})",
                        status,
                    )

    def _await_statuses(self) -> None:
        keys = [f"{self.session}/status/{rank}" for rank in range(1, self.world)]

        def arrived() -> bool:
            self._receiver_failed(self.store)
            return all(grp.has(self.store, key) for key in keys)

        def silent() -> TransferTimeout:  # name who is missing: over NCCL a dead receiver can leave the stream whole
            ranks = ", ".join(str(rank) for rank, key in enumerate(keys, 1) if not grp.has(self.store, key))
            return TransferTimeout(
                f"draining: receiver rank(s) {ranks} did not report the end of session {self.session} (bucket "
                f"{self.seq - 1} was the last) within timeout_s={self.timeout_s:g}; dead? (raise timeout_s if a loader "
                "is only slow)"
            )

        grp.wait_until(arrived, deadline=time.monotonic() + self.timeout_s, on_timeout=silent)
        for rank, key in enumerate(keys, 1):
            status = grp.open_signed(self.secret, "status", grp.get(self.store, key), f"receiver rank {rank}'s status")
            if status.get("ok") is not True or status.get("session") != self.session:
                _raise_reported(f"draining: receiver rank {rank} failed", status)


def _raise_reported(what: str, status: dict[str, Any]) -> None:
    """TransferError for a receiver's failure report ``status``: ``what``, then the receiver's own message; its
    exception's type and last frames as attributes, and a ``RemoteError`` standing for it as the cause."""
    message = str(status.get("message"))
    remote = remote_failure(status)
    error = TransferError(
        f"{what}: {message}",
        remote_message=message,
        remote_type=remote.remote_type if remote else None,
        remote_traceback=remote.remote_traceback if remote else None,
    )
    if remote is None:
        raise error
    raise error from remote


def _piece_ranges(entries: list[Any]) -> list[tuple[int, int]]:
    """(offset, bytes) of each non-empty tensor or piece of a bucket's wire entries, the cut a per-tensor receiver
    makes from the same entries."""
    ranges = []
    for item in entries:
        if len(item) == 6:
            nbytes = item[5]
        else:
            nbytes = SUPPORTED_DTYPES[item[1]].itemsize
            for size in item[2]:
                nbytes *= size
        if nbytes:
            ranges.append((item[3], nbytes))
    return ranges
