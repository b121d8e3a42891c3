"""Weights to engines on other GPUs or nodes: a torch.distributed broadcast over a group of the sync's own.

``BroadcastWeightSender`` hosts a TCPStore at the rendezvous the user gives (``tcp://host:port``) and
each ``send(weights, version=...)`` is one session: it offers the session in the store, admits
exactly ``receivers`` receivers (ranks 1..N, each proving it knows the job's secret), forms a new
process group of its own for them (gloo on CPU, NCCL on GPU; never the trainer's or the engine's
default group) and broadcasts the stream bucket by bucket, packing the next bucket into the other
half of its buffer while the current one is on the wire. Each bucket is three broadcasts: a header
(metadata and data sizes), the metadata (msgpack, ``protocol``'s ``bucket`` frame: names, dtypes,
shapes, offsets, no pickle) and the bucket's bytes (with ``per_tensor=True``, one broadcast per tensor or
piece instead, so that a receiver with a load plan lands each one in its own memory; see
``BroadcastWeightReceiver.receive(direct=...)``). At the end every receiver posts its outcome;
``send()`` returns once all did, raises ``TransferError`` carrying a receiver's own message if one
failed, ``TransferTimeout`` naming the phase, bucket and peer if a wait ran past ``timeout_s`` (the
group is aborted: for NCCL that is the only way out of a stuck collective), and ``PeerGone`` (a
``TransferTimeout``) when a receiver's connection broke. The group is torn down after every session
and the next session forms a new one, so a failed session leaves nothing out of step.

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

from refitkit.errors import InvalidInput, ProtocolError, TransferError, TransferTimeout
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
        self.last_timings_s: dict[str, float] = {}

    def close(self) -> None:
        """Stop hosting the rendezvous; the sender cannot send afterwards."""
        self._store = None

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
            raise TransferError(f"broadcast sender on tcp://{self.host}:{self.port} is closed")
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
            )
            self.last_timings_s = run.timings
            try:
                return run.run()
            finally:
                self._stale = run.session, run.keys
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
        self.group: Any = None
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
            self._admit()
            began = time.perf_counter()
            self.group = grp.form_group(self.store, self.session, 0, self.world, self.backend, self.timeout_s)
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
            holder, self.group = [self.group], None
            grp.close_group(holder, failed=failed)

    # -- admission --------------------------------------------------------------------------------

    def _admit(self) -> None:
        """Every rank's join present and proven, then ``go``; ProtocolError naming a rank that failed the check."""
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
        for rank, key in enumerate(joins, 1):
            expected = grp.tag(self.secret, "join", self.session, self.nonce, rank)
            if not grp.hmac.compare_digest(grp.get(self.store, key), expected):
                raise ProtocolError(
                    f"handshake: receiver rank {rank}'s join failed the secret check (a wrong secret, another job on "
                    f"this rendezvous, or an intruder); session {self.session} was called off before any weight was sent"
                )
        grp.put(self.store, f"{self.session}/go", grp.tag(self.secret, "go", self.session))

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
