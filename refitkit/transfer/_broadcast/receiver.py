"""The engine side of a broadcast sync, and the weight version it serves (see ``_broadcast/sender.py`` for the
session, the rendezvous and the security model).

``BroadcastWeightReceiver(rendezvous, secret=..., rank=r)`` is one engine worker (rank ``r`` in
1..N of every session's group), the engine's end of a channel: keep it across syncs. It keeps its connection
to the sender's store and the group of its last sync that ended well, so the next sync runs on that group
without forming one (the sender decides: a group every member holds is reused, else a new one is formed and
the old one dropped); a failed sync drops both, and the next call connects and joins afresh. ``close()`` (or
``with``) drops them for good: a later ``receive()`` raises ``ChannelClosed``. ``receive(on_bucket)`` waits
for the sender's next offer, proves it knows the secret, joins, and calls ``on_bucket(weights, is_last)`` once per bucket with views of its
own bucket buffer (valid only during the call: copy what you keep; a tensor larger than the bucket
arrives reassembled). Everything from the wire is checked before use: the offer's and the sender's
signatures, the header's sizes against ``MAX_FRAME_BYTES`` and the announced bucket, and the
metadata with ``protocol``'s own checks; a bad frame is a ``ProtocolError`` and the session ends.

One copy where layouts allow: ``receive(on_bucket, direct=plan)`` with a sender of ``per_tensor=True``
receives each weight that ``plan`` places (``rollout.load_plan``: a whole parameter or rows of a fused
one, same dtype and shape) straight into that memory; the others reach ``on_bucket`` as usual.
``last_direct`` says how the bytes split and which planned names fell back, and why.

Weight versions: ``weights_version`` says which version the receiver's weights are. A session that
lands whole sets ``version`` and clears ``incomplete``; one that fails after it handed out its
first bucket leaves the weights partly updated, so ``incomplete`` holds that session's version
(and ``clean`` is False) until a later session lands whole. A session that fails before its first
bucket leaves the weights, and the version, as they were.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from refitkit.errors import (
    ChannelClosed,
    InvalidInput,
    PeerGone,
    ProtocolError,
    RefitError,
    TransferError,
    TransferTimeout,
)
from refitkit.offload.device import resolved_device
from refitkit.transfer._broadcast import group as grp
from refitkit.transfer._broadcast.sender import checked_backend
from refitkit.transfer.common import (
    ChannelState,
    SessionPhase,
    TransferStats,
    WeightVersion,
    checked_device,
    checked_knobs,
)
from refitkit.transfer.protocol import (
    MAX_FRAME_BYTES,
    SplitProgress,
    brief,
    bucket_fields,
    check_split_fits,
    check_split_pieces,
    decode,
    entries_from_wire,
    expect,
    failure_fields,
)

log = logging.getLogger("refitkit.transfer.broadcast")

# The sender decides (go, or abort naming the missing rank) within timeout_s of its offer; a receiver that
# joined waits a little longer, so that it hears the sender's reason instead of timing out alongside it.
GO_GRACE_S = 1.0

OnBucket = Callable[[list[tuple[str, torch.Tensor]], bool], Any]
# direct(name, dtype, shape): the memory a streamed weight should land in (e.g. a rollout.load_plan.BoundPlan), or None
Direct = Callable[[str, torch.dtype, tuple[int, ...]], "torch.Tensor | None"]


@dataclass(frozen=True)
class DirectStats:
    """How a ``receive(direct=...)`` session split its bytes: ``direct_bytes`` (``direct_tensors`` tensors) landed
    straight in the engine's memory, ``bucket_bytes`` went through the bucket to ``on_bucket``; ``fallbacks`` maps
    each name that had a destination but could not use it to why."""

    direct_bytes: int = 0
    direct_tensors: int = 0
    bucket_bytes: int = 0
    fallbacks: dict[str, str] = field(default_factory=dict)

    @property
    def direct_share(self) -> float:
        total = self.direct_bytes + self.bucket_bytes
        return self.direct_bytes / total if total else 0.0


class BroadcastWeightReceiver:
    """One engine worker's end of a broadcast channel; one session per ``receive()`` (see the module docstring)."""

    def __init__(
        self,
        rendezvous: str | tuple[str, int],
        *,
        secret: bytes | str,
        rank: int,
        device: str | torch.device = "cpu",
        backend: str = "gloo",
        timeout_s: float = 120.0,
    ) -> None:
        self.timeout_s, _, _ = checked_knobs(timeout_s=timeout_s)
        self._secret = grp.checked_secret(secret)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise InvalidInput(f"rank={rank!r}; need an int >= 1 (rank 0 is the sender; receivers are 1..receivers)")
        self.rank = rank
        self.device = checked_device(device)
        self.backend = checked_backend(backend, self.device)
        self.host, self.port = grp.parse_rendezvous(rendezvous)
        self.weights_version = WeightVersion()
        self.last_stats: TransferStats | None = None
        self.last_direct: DirectStats | None = None
        self._last_session: str | None = None  # served (or failed): its offer is not taken twice
        self.state = ChannelState.OPEN
        self._store: Any = None  # the sender's store, connected by the first sync, kept while syncs end well
        self._group: Any = None  # the group of the last sync that ended well (None: the next sync joins a new one)
        self.group_id: str | None = None
        self.groups_formed = 0  # how many groups this receiver joined in forming

    def close(self) -> None:
        """Drop the kept group and the store connection; idempotent. A later ``receive()`` raises ChannelClosed."""
        if self.state is ChannelState.EXCHANGING:
            raise TransferError(f"receiver rank {self.rank}: close() during a receive() (call it after that returns)")
        self._drop(failed=False)
        self.state = self.state.to(ChannelState.CLOSED)

    def __enter__(self) -> BroadcastWeightReceiver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _drop(self, *, failed: bool) -> None:
        holder, self._group, self.group_id, self._store = [self._group], None, None, None
        grp.close_group(holder, failed=failed)

    def receive(self, on_bucket: OnBucket, *, direct: Direct | None = None) -> TransferStats:
        """Run the sender's next session, calling ``on_bucket(weights, is_last)`` per bucket; returns after
        this receiver posted its success (the sender returns once every receiver did).

        With ``direct`` (e.g. a bound ``rollout.load_plan`` plan) and a sender with ``per_tensor=True``, a
        weight for which ``direct(name, dtype, shape)`` gives a contiguous tensor of that dtype, shape and this
        receiver's device is received straight into it and not handed to ``on_bucket``; any other weight takes
        the bucket path (a destination that does not fit is logged and listed in ``last_direct.fallbacks``)."""
        if self.state is ChannelState.CLOSED:
            raise ChannelClosed(
                f"broadcast receiver rank {self.rank} of tcp://{self.host}:{self.port} is closed; make a new one"
            )
        if self.state is ChannelState.EXCHANGING:
            raise TransferError(f"broadcast receiver rank {self.rank} runs one receive() at a time, and one is running")
        self.state = self.state.to(ChannelState.EXCHANGING)
        run = _BroadcastReceive(
            on_bucket,
            direct,
            secret=self._secret,
            timeout_s=self.timeout_s,
            rank=self.rank,
            host=self.host,
            port=self.port,
            backend=self.backend,
            device=self.device,
            last_session=self._last_session,
            # (no local keeps the group: a traceback holding it would make this thread wait in its destructor)
            kept=(self._store, self.group_id, self._group),
        )
        self._store = self._group = self.group_id = None  # the session holds them, and hands them back if it ends well
        try:
            stats = run.run()
        except BaseException:
            if run.touched:
                self.weights_version = WeightVersion(self.weights_version.version, run.version)
            raise
        finally:
            self.state = self.state.to(ChannelState.OPEN)
            self.last_direct = run.direct_stats()
            self.groups_formed += run.formed
            if run.session is not None:  # its offer was taken: served or failed, never taken twice
                self._last_session = run.session
        self._store, self.group_id, self._group = run.take_kept()
        self.weights_version = WeightVersion(run.version, None)
        self.last_stats = stats
        return stats


class _BroadcastReceive:
    """One session of a receiver: the store connection, the offer, the group and the bucket buffer."""

    def __init__(
        self,
        on_bucket: OnBucket,
        direct: Direct | None,
        *,
        secret: bytes,
        timeout_s: float,
        rank: int,
        host: str,
        port: int,
        backend: str,
        device: torch.device,
        last_session: str | None,
        kept: tuple[Any, str | None, Any],
    ) -> None:
        self.on_bucket, self.direct = on_bucket, direct
        self.host, self.port, self.backend, self.device = host, port, backend, device
        self.last_session = last_session  # the receiver's previous session (served or failed): not taken twice
        self.per_tensor = False  # the sender broadcasts each tensor (piece) on its own: receiving in place is possible
        self.split_landing: torch.Tensor | None = None  # the bytes of a split tensor landing in place
        self.direct_bytes = self.direct_tensors = self.bucket_bytes = 0
        self.fallbacks: dict[str, str] = {}
        self.secret, self.timeout_s, self.rank = secret, timeout_s, rank
        self.store, self.group_id, self.group = kept  # the receiver's store connection and kept group, if any
        self.formed = 0  # 1 if this session formed its group
        self.session: str | None = None
        self.version: int | None = None
        self.touched = False  # on_bucket was called: the engine's weights may be partly updated
        self.phase = SessionPhase.HANDSHAKE
        self.seq = 0

    def run(self) -> TransferStats:
        start = time.perf_counter()
        failed = True
        try:
            if self.store is None:
                self.store = grp.connect_store(self.host, self.port, is_master=False, timeout_s=self.timeout_s)
            with self._sender_link("waiting for an offer"):
                offer = self._take_offer()
            with self._sender_link("joining"):
                group_id, fresh = self._join(offer)
            if fresh or group_id != self.group_id or self.group is None:
                self._drop_group(failed=True)  # (aborted: a member that is gone must not hold up its shutdown)
                self.group_id = group_id
                self.group = grp.form_group(
                    self.store, group_id, self.rank, offer["world"], self.backend, self.timeout_s
                )
                self.formed = 1
            self.phase = SessionPhase.STREAMING
            total, count = self._stream(offer["half_bytes"])
            self.phase = SessionPhase.RELEASED
            with self._sender_link("posting its success"):
                grp.put(
                    self.store,
                    f"{self.session}/status/{self.rank}",
                    grp.sign(
                        self.secret,
                        "status",
                        {
                            "session": self.session,
                            "ok": True,
                            "message": None,
                        },
                    ),
                )
            failed = False
            return TransferStats(
                bytes=total, tensors=count, buckets=self.seq, seconds=time.perf_counter() - start, ack_wait_s=0.0
            )
        except BaseException as exc:  # reported before the group goes, so the sender learns why, not only that
            self.report_failure(exc)
            raise
        finally:
            if failed:  # the group may be out of step or broken, the store gone: the next sync starts afresh
                self._drop_group(failed=True)
                self.store = None

    def _drop_group(self, *, failed: bool) -> None:
        holder, self.group, self.group_id = [self.group], None, None
        grp.close_group(holder, failed=failed)

    def take_kept(self) -> tuple[Any, str | None, Any]:
        """The store connection and the group of a session that ended well, for the receiver to keep."""
        kept = self.store, self.group_id, self.group
        self.store = self.group = self.group_id = None
        return kept

    # -- handshake --------------------------------------------------------------------------------

    def _take_offer(self) -> dict[str, Any]:
        """The sender's next offer (not one this receiver already served), signature and fields checked."""

        def fresh() -> dict[str, Any] | None:
            if not grp.has(self.store, "offer"):
                return None
            raw = grp.get(self.store, "offer")
            if len(raw) > grp.MAX_OFFER_BYTES:
                raise ProtocolError(f"handshake: the offer is {len(raw)} bytes, more than {grp.MAX_OFFER_BYTES}")
            offer = grp.open_signed(self.secret, "offer", raw, "handshake: the sender's offer")
            return None if offer.get("session") == self.last_session else offer

        offer = grp.wait_until(
            fresh,
            deadline=time.monotonic() + self.timeout_s,
            on_timeout=lambda: TransferTimeout(
                f"handshake: no new session offered at tcp://{self.host}:{self.port} within "
                f"timeout_s={self.timeout_s:g} (receiver rank {self.rank}); is the sender calling send()?"
            ),
        )
        session, version, world, half = (offer.get(key) for key in ("session", "version", "world", "half_bytes"))
        if not (
            type(session) is str
            and session
            and type(version) is int
            and type(world) is int
            and type(half) is int
            and 0 < half <= grp.MAX_HALF_BYTES
            and offer.get("backend") == self.backend
            and type(offer.get("nonce")) is bytes
        ):
            raise ProtocolError(f"handshake: malformed offer {brief(offer)} (or backend other than {self.backend!r})")
        if not 1 <= self.rank < world:
            raise InvalidInput(
                f"receiver rank {self.rank} is not in the sender's group of {world} (ranks 1..{world - 1})"
            )
        if type(offer.get("per_tensor", False)) is not bool:
            raise ProtocolError(f"handshake: malformed offer {brief(offer)}: per_tensor is not a bool")
        self.per_tensor = offer.get("per_tensor", False)
        if self.direct is not None and not self.per_tensor:
            log.warning(
                "receiver rank %d: direct= given but session %s's sender sends whole buckets; every weight takes the "
                "bucket path (BroadcastWeightSender(per_tensor=True) lets planned weights land in place)",
                self.rank,
                session,
            )
        self.session, self.version = session, version  # from here on the receiver will not take this offer again
        return offer

    def _join(self, offer: dict[str, Any]) -> tuple[str, bool]:
        """Join the session saying which group this receiver holds; the group the sender says it runs on, and
        whether that group is to be formed now."""
        key = f"{grp.PREFIX}{self.session}/join/{self.rank}"
        held = self.group_id if self.group is not None else None
        mine = grp.join_value(self.secret, self.session, offer["nonce"], self.rank, held or "")
        if bytes(self.store.compare_set(key, "", mine)) != mine:
            raise TransferError(
                f"handshake: rank {self.rank} already joined session {self.session}: two receivers with one rank? "
                "(each engine worker needs its own rank in 1..receivers)"
            )
        go, off = f"{self.session}/go", f"{self.session}/abort"
        grp.wait_until(
            lambda: grp.has(self.store, go) or grp.has(self.store, off),
            deadline=time.monotonic() + self.timeout_s + GO_GRACE_S,
            on_timeout=lambda: TransferTimeout(
                f"handshake: the sender did not start session {self.session} within timeout_s={self.timeout_s:g} (+{GO_GRACE_S:g} s) "
                f"after receiver rank {self.rank} joined (another receiver missing?)"
            ),
        )
        self._sender_gave_up(self.store)
        fields = grp.open_signed(self.secret, "go", grp.get(self.store, go), f"handshake: session {self.session}'s go")
        group_id, fresh = fields.get("group"), fields.get("fresh")
        if fields.get("session") != self.session or type(group_id) is not str or type(fresh) is not bool:
            raise ProtocolError(f"handshake: malformed go {brief(fields)} for session {self.session}")
        if not fresh and group_id != held:
            raise ProtocolError(
                f"handshake: the sender runs session {self.session} on group {group_id}, which receiver rank "
                f"{self.rank} does not hold (it said {held or 'none'})"
            )
        return group_id, fresh

    @contextlib.contextmanager
    def _sender_link(self, doing: str) -> Iterator[None]:
        """Store calls inside: the store's host is the sender, so a store that stopped answering (torch's
        ``DistNetworkError`` / ``DistStoreError``) means the sender died or closed: PeerGone naming it, chained."""
        try:
            yield
        except RefitError:
            raise
        except (RuntimeError, OSError) as exc:
            where = f"bucket {self.seq} of session {self.session}" if self.session else "before any session"
            raise PeerGone(
                f"{self.phase.value}: the sender (rank 0) stopped answering at tcp://{self.host}:{self.port} while "
                f"receiver rank {self.rank} was {doing} ({where}): {type(exc).__name__}: {brief(str(exc))}; did it "
                f"die or close? Nothing is left to wait for within timeout_s={self.timeout_s:g}"
            ) from exc

    def _sender_gave_up(self, store: Any) -> None:
        with self._sender_link("watching for the sender's abort"):
            self._read_abort(store)

    def _read_abort(self, store: Any) -> None:
        if grp.has(store, f"{self.session}/abort"):
            fields = grp.open_signed(
                self.secret, "abort", grp.get(store, f"{self.session}/abort"), "the sender's abort"
            )
            reason = str(fields.get("reason"))
            raise TransferError(
                f"{self.phase.value}: the sender called session {self.session} (version {self.version}) off at bucket "
                f"{self.seq}: {reason}",
                remote_message=reason,
            )

    # -- streaming --------------------------------------------------------------------------------

    def _await(self, work: Any, what: str, *, deadline: float | None = None) -> None:
        """Wait for ``work`` (bounded by ``deadline``, default ``timeout_s`` from now); abort the group on a timeout."""
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        grp.await_work(
            work,
            lambda: grp.abort(self.group),
            deadline=deadline,
            timeout_s=self.timeout_s,
            where=f"{self.phase.value}: {what} of bucket {self.seq} of session {self.session}",
            peer="the sender (rank 0)",
            store=self.store,
            gave_up=self._sender_gave_up,
        )

    def _stream(self, half_bytes: int) -> tuple[int, int]:
        device = self.device
        wire = torch.device("cpu") if self.backend == "gloo" else device
        try:
            buffer = torch.empty(2 * half_bytes, dtype=torch.uint8, device=device)
        except RuntimeError as exc:  # out of memory: name what could not be had, and whose knob sized it
            raise TransferError(
                f"streaming: receiver rank {self.rank} cannot allocate session {self.session}'s bucket of "
                f"{2 * half_bytes} bytes on {device} ({type(exc).__name__}: {brief(str(exc))}); the sender's "
                "bucket_bytes sizes it: pass a smaller one"
            ) from exc
        progress: SplitProgress | None = None
        split: torch.Tensor | None = None  # the split tensor being reassembled
        total = count = 0
        while True:
            header = torch.zeros(2, dtype=torch.int64, device=wire)
            self._await(grp.broadcast(self.group, header), "the header")
            meta_bytes, data_bytes = (int(value) for value in header.tolist())
            if not (0 < meta_bytes <= MAX_FRAME_BYTES and 0 <= data_bytes <= buffer.numel()):
                raise ProtocolError(
                    f"streaming: bucket {self.seq}'s header announces {meta_bytes} metadata bytes and {data_bytes} data "
                    f"bytes; at most {MAX_FRAME_BYTES} and the bucket's {buffer.numel()}"
                )
            meta = torch.empty(meta_bytes, dtype=torch.uint8, device=wire)
            self._await(grp.broadcast(self.group, meta), "the metadata")
            frame = expect(decode(meta.cpu().numpy().tobytes()), "bucket", session=self.session)
            _, _, last = bucket_fields(frame, self.seq)
            if frame.get("nbytes") != data_bytes:
                raise ProtocolError(
                    f"streaming: bucket {self.seq} says {brief(frame.get('nbytes'))} bytes, its header {data_bytes}"
                )
            entries = entries_from_wire(frame.get("entries"), capacity=data_bytes)
            progress = check_split_pieces(entries, progress, last=last)
            landings = self._landings(entries) if self.per_tensor else [None] * len(entries)
            if data_bytes and self.per_tensor:
                self._receive_pieces(entries, landings, buffer)
            elif data_bytes:
                self._await(grp.broadcast(self.group, buffer[:data_bytes]), "the bytes")
            weights: list[tuple[str, torch.Tensor]] = []
            for entry, landing in zip(entries, landings):
                if landing is not None:  # already in the engine's memory
                    self.direct_bytes += entry.nbytes
                    self.direct_tensors += entry.completes
                    continue
                self.bucket_bytes += entry.nbytes
                piece = buffer[entry.offset : entry.offset + entry.nbytes]
                if entry.whole:
                    weights.append((entry.name, piece.view(entry.dtype).view(entry.shape)))
                    continue
                if entry.start == 0:
                    check_split_fits(entry, device)
                    split = torch.empty(entry.total, dtype=torch.uint8, device=device)
                if split is None:
                    raise ProtocolError(f"streaming: {entry.name!r} continues a split tensor that never started")
                split[entry.start : entry.start + entry.nbytes].copy_(piece)
                if entry.completes:
                    weights.append((entry.name, split.view(entry.dtype).view(entry.shape)))
                    split = None
            self.touched = True
            self.on_bucket(weights, last)
            count += len(weights)
            total += sum(tensor.nbytes for _, tensor in weights)
            del weights
            self.seq += 1
            if last:
                return total, count

    # -- landing in place -------------------------------------------------------------------------

    def _landings(self, entries: list[Any]) -> list[torch.Tensor | None]:
        """Per entry, the bytes of engine memory it lands in, or None for the bucket path."""
        landings: list[torch.Tensor | None] = []
        for entry in entries:
            if entry.start == 0:
                target = self._target(entry) if self.direct is not None else None
                if not entry.whole:
                    self.split_landing = target
                landings.append(None if target is None else target[: entry.nbytes])
            elif self.split_landing is not None:  # a later piece of a split tensor that lands in place
                landings.append(self.split_landing[entry.start : entry.start + entry.nbytes])
            else:
                landings.append(None)
        return landings

    def _target(self, entry: Any) -> torch.Tensor | None:
        """``direct``'s destination for ``entry`` as flat bytes, if it fits exactly; else None, noted once a name."""
        try:
            target = self.direct(entry.name, entry.dtype, entry.shape)  # type: ignore[misc]
        except Exception as exc:  # a plan that cannot answer costs the bucket path, never the session
            return self._fall_back(entry.name, f"direct() raised {type(exc).__name__}: {exc}")
        if target is None:
            return None
        if not isinstance(target, torch.Tensor):
            return self._fall_back(entry.name, f"direct() gave a {type(target).__name__}, not a tensor")
        if target.dtype != entry.dtype or tuple(target.shape) != entry.shape:
            return self._fall_back(
                entry.name,
                f"the plan says {target.dtype} {tuple(target.shape)}, the sender sent {entry.dtype} {entry.shape}",
            )
        if resolved_device(target.device) != resolved_device(self.device) or not target.is_contiguous():
            return self._fall_back(
                entry.name,
                f"the destination is on {target.device} (contiguous={target.is_contiguous()}), the receiver on {self.device}",
            )
        return target.view(-1).view(torch.uint8)

    def _fall_back(self, name: str, reason: str) -> None:
        if name not in self.fallbacks:
            log.warning("receiver rank %d: %r takes the bucket path: %s", self.rank, name, reason)
        self.fallbacks[name] = reason
        return None

    def _receive_pieces(self, entries: list[Any], landings: list[torch.Tensor | None], buffer: torch.Tensor) -> None:
        """One broadcast per entry, as the sender cut them, each into its landing or its place in the bucket."""
        if any(landing is not None for landing in landings):
            self.touched = True  # the engine's own memory is being written from here on
        works = []
        for entry, landing in zip(entries, landings):
            if entry.nbytes:
                into = landing if landing is not None else buffer[entry.offset : entry.offset + entry.nbytes]
                works.append(grp.broadcast(self.group, into))
        deadline = time.monotonic() + self.timeout_s  # one bound for the bucket's pieces together
        for work in works:
            self._await(work, "the bytes", deadline=deadline)

    def direct_stats(self) -> DirectStats:
        return DirectStats(self.direct_bytes, self.direct_tensors, self.bucket_bytes, dict(self.fallbacks))

    # -- failure ----------------------------------------------------------------------------------

    def report_failure(self, exc: BaseException) -> None:
        """Post this receiver's failure (signed, so that the sender stops at once), best effort."""
        if self.store is None or self.session is None:
            return
        try:
            message = f"{type(exc).__name__}: {exc}"[:4000]
            grp.put(
                self.store,
                f"{self.session}/status/{self.rank}",
                grp.sign(
                    self.secret,
                    "status",
                    {
                        "session": self.session,
                        "ok": False,
                        "message": message,
                        **failure_fields(exc),
                    },
                ),
            )
            self.store.add(f"{grp.PREFIX}{self.session}/failures", 1)
        except (RuntimeError, OSError) as late:
            log.warning(
                "receiver rank %d could not report its failure of session %s: %s", self.rank, self.session, late
            )
