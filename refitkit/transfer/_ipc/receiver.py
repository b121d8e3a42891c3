"""The inference side of a weight sync: map the sender's bucket once, hand out tensors, release, ACK.

``receive(on_bucket)`` calls ``on_bucket(weights, is_last)`` once per bucket (at least once: an
empty stream gives one call with ``[]`` and ``is_last=True``). ``iter_weights()`` is the same
session as one generator. Tensors are views into the bucket (also a tensor larger than a half,
which comes whole in a wide bucket; only tensors larger than the whole bucket are split across
buckets and reassembled on the receiver's device) and are valid only during the call / until the
next tensor is requested: copy what you keep. A GPU receiver on the shm transport hands out views
of a device staging buffer instead, under the same rule: a view kept past release is an error.

Ordering that keeps the sender's memory free: after the last bucket the receiver drops every
view, unmaps the bucket (and on CUDA runs ``ipc_collect`` + ``empty_cache``) and only then sends
the final ACK. Any failure (``on_bucket`` raising, also ``KeyboardInterrupt`` / ``SystemExit``,
which are re-raised as they are after the report; a view kept past release, a sender abort, a
timeout) also releases first and, when the sender can still hear it, reports an error frame.

Streams: on CUDA the receiver hands a bucket back (its half may then be overwritten by the sender)
and unmaps it once the work queued *so far* on the current stream has run. A loader that reads the
bucket on other streams (its own copy streams) must hand them over with ``receiver.wait_on(stream,
...)`` from inside ``on_bucket`` / the loop over ``iter_weights()``: every hand-back and the release
then also wait for the work queued on those streams, for the rest of the session. Reads on a stream
the receiver does not know about may see bytes of the next bucket.

Bounds: every wait is bounded by ``timeout_s``, and the whole sync, hello to final ACK, by ``max_sync_s``
(a sender that keeps sending buckets never marked last cannot keep a receiver busy forever). A sender that
dies is noticed by its connection (``liveness``): the wait raises ``PeerGone`` at once.

Everything from the wire is checked before it is used (``protocol``): offsets, lengths, shapes and
sequence numbers against the session's announced bucket, the mapping's real size and the tensor's
own totals; a split tensor may not be larger than the receiving device's memory. A bad frame is a
ProtocolError; the session releases and reports it.
"""

from __future__ import annotations

import enum
import logging
import os
import secrets
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import zmq

from refitkit.errors import ChannelClosed, InvalidInput, PeerGone, ProtocolError, TransferError, TransferTimeout
from refitkit.transfer._ipc import cuda_ipc, handoff, shm
from refitkit.transfer._ipc.endpoint import close_watched, connect_receiver, socket_path
from refitkit.transfer._ipc.liveness import FRAMES_PER_LOOK, PeerWatch, recv_frame
from refitkit.transfer.common import (
    ChannelState,
    SessionPhase,
    TransferStats,
    checked_device,
    checked_knobs,
    checked_seconds,
)
from refitkit.transfer.protocol import (
    ALIGN_BYTES,
    MAX_IN_FLIGHT,
    MAX_TENSOR_BYTES,
    Entry,
    SplitProgress,
    align_up,
    brief,
    bucket_fields,
    check_split_fits,
    check_split_pieces,
    contiguous_strides,
    decode,
    direct_allocs,
    direct_header,
    encode,
    entries_from_wire,
    expect,
    failure_fields,
    setup_fields,
    timeout_error,
)

OnBucket = Callable[[list[tuple[str, torch.Tensor]], bool], Any]
T = TypeVar("T")

MAX_SYNC_S = 3600.0  # the default bound of one whole sync: far beyond any real one, short of forever

# A session's phases as ``last_timings_s`` names them: handshake (hello to ready), waits for the sender's frames and
# bytes, mapping its memory, the caller's on_bucket, the release (of it: the stream's reads, closing the mappings,
# torch's caches) and closing the socket.
RECEIVE_PHASES = (
    "handshake",
    "frames",
    "packed",
    "map",
    "on_bucket",
    "release",
    "release_sync",
    "release_close",
    "release_flush",
    "close",
)


class ReceiverChannel:
    """One engine rank's end of its link to a trainer rank's ``SenderChannel``: connected once, one sync (exchange)
    per ``receive()`` / ``iter_weights()``, closed by ``close()`` (or ``with``).

    The channel owns what syncs share and nothing outlives it: its ZMQ context and its one connection to the sender
    (made at construction; frames queue until the sender binds), the watch over that connection (a sender that
    dies ends a running sync at once with ``PeerGone``), and the plans of the direct buckets it laid out (a held
    model's next sync reuses them). A failed sync ends that sync only: the channel is open again for the next, and
    frames left over from the failed one are told apart (each sync's hello carries its own token) and dropped.
    Keep one channel across syncs; each new one pays a connection and lays its buckets out again.

    ``timeout_s`` bounds each wait for the sender; ``max_sync_s`` the whole of one sync, from its hello to its final
    ACK (the loader's time included): past it the sync fails with ``TransferTimeout`` naming the knob. A channel
    belongs to the process that opened it: in a forked child every call raises ``ChannelClosed``.
    """

    def __init__(
        self, endpoint: str, device: str | torch.device, timeout_s: float = 120.0, *, max_sync_s: float = MAX_SYNC_S
    ) -> None:
        self.timeout_s, _, _ = checked_knobs(timeout_s=timeout_s)
        self.max_sync_s = checked_seconds(max_sync_s, "max_sync_s")
        self.device = checked_device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.endpoint = endpoint
        self.path = socket_path(endpoint)
        self.state = ChannelState.OPEN
        self.last_stats: TransferStats | None = None
        self.last_timings_s: dict[str, float] = {}  # seconds per phase of the last sync, for benchmarks
        self._active: _ReceiveSession | None = None  # the sync running now, for wait_on()
        self._plans: dict[int, _DirectPlan] = {}  # direct buckets as the last syncs laid them out (by seq)
        self._pid = os.getpid()
        # A context of its own, not ``zmq.Context.instance()``: an engine that terminates its global instance must
        # not close our socket. Its I/O thread lives as long as the channel.
        self._context = zmq.Context()
        try:
            self._sock, self._watch = connect_receiver(self._context, self.path)
        except BaseException:
            self._context.term()
            raise
        # A channel dropped without close() still lets its socket, watch and context go (never in a forked child).
        self._finalizer = weakref.finalize(self, _close_connection, self._pid, self._sock, self._watch, self._context)

    # -- lifecycle --------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection and the context; idempotent. A sync still running (an ``iter_weights()`` generator
        not finished) is failed first: its sender hears of it, the mappings are released. In a forked child it only
        forgets the parent's objects (they are the parent's to close)."""
        if self.state is ChannelState.CLOSED:
            return
        if os.getpid() != self._pid:
            self.state = ChannelState.CLOSED
            self._finalizer.detach()
            return
        session = self._active
        if session is not None:
            session.fail("the receiver channel was closed during the sync")
            session.close()
            self._active = None
        self.state = self.state.to(ChannelState.CLOSED)
        self._plans.clear()
        self._finalizer()

    def __enter__(self) -> ReceiverChannel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _begin(self) -> _ReceiveSession:
        """The next sync on this channel (one at a time, in the process that opened it)."""
        if os.getpid() != self._pid:
            raise ChannelClosed(
                f"the receiver channel on {self.endpoint!r} was opened in process {self._pid}; this is process "
                f"{os.getpid()} (a fork?): open a channel of its own here"
            )
        if self.state is ChannelState.CLOSED:
            raise ChannelClosed(f"the receiver channel on {self.endpoint!r} is closed; open a new one")
        if self.state is ChannelState.EXCHANGING:
            raise TransferError(
                f"the receiver channel on {self.endpoint!r} runs one sync at a time, and one is running (an "
                "iter_weights() generator not exhausted or closed?)"
            )
        self.state = self.state.to(ChannelState.EXCHANGING)
        session = self._active = _ReceiveSession(
            endpoint=self.endpoint,
            sock=self._sock,
            watch=self._watch,
            device=self.device,
            timeout_s=self.timeout_s,
            max_sync_s=self.max_sync_s,
            plans=self._plans,
        )
        self.last_timings_s = session.timings
        return session

    def _end(self, session: _ReceiveSession) -> None:
        """The sync ended (well or not): release what it still holds; the channel is open for the next."""
        if self._active is session:
            self._active = None
        session.close()
        if self.state is ChannelState.EXCHANGING:
            self.state = self.state.to(ChannelState.OPEN)

    # -- one sync ---------------------------------------------------------------------------------

    def wait_on(self, *streams: Any) -> None:
        """From inside ``on_bucket`` / a loop over ``iter_weights()``: also wait for work queued on ``streams``
        (torch.cuda.Stream) before each bucket is handed back and before the release, for this sync."""
        session = self._active
        if session is None or session.phase is not SessionPhase.STREAMING:
            raise InvalidInput("wait_on() is for the streams of a running session: call it from on_bucket or the loop")
        for stream in streams:
            if not isinstance(stream, torch.cuda.Stream) or self.device.type != "cuda":
                raise InvalidInput(
                    f"wait_on({brief(stream)}): need torch.cuda.Stream objects on a CUDA receiver ({self.device})"
                )
            session.streams.setdefault(stream.cuda_stream, stream)

    def receive(self, on_bucket: OnBucket) -> TransferStats:
        """Run one sync, calling ``on_bucket(weights, is_last)`` per bucket; returns after the final ACK."""
        session = self._begin()
        try:
            session.open()
            while True:
                weights, last = session.next_bucket()
                failure = cause = interrupted = None
                began = time.perf_counter()
                try:
                    on_bucket(weights, last)
                except Exception as exc:  # reported to the sender (with its type and frames), then chained here
                    failure, cause = f"on_bucket raised {type(exc).__name__}: {exc}", _without_locals(exc)
                except BaseException as exc:  # KeyboardInterrupt, SystemExit: report, release, then re-raise it
                    failure = f"on_bucket was interrupted by {type(exc).__name__}: {exc}"
                    cause = interrupted = exc.with_traceback(None)  # its frames hold the views
                weights = None
                session.timings["on_bucket"] += time.perf_counter() - began
                if failure is not None:
                    session.fail(failure, cause=cause)
                    if interrupted is not None:
                        raise interrupted
                    raise TransferError(failure) from cause
                session.bucket_consumed(last)
                if last:
                    self.last_stats = session.stats()
                    return self.last_stats
        except BaseException as exc:  # also an interrupt while waiting: the sender must hear of it now
            session.fail(f"receiver gave up: {type(exc).__name__}: {exc}", cause=exc)
            raise
        finally:
            self._end(session)

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The sync as one generator; release + final ACK happen when it is exhausted or closed."""
        session = self._begin()
        yielded = 0
        complete = False
        try:
            session.open()
            while True:
                weights, last = session.next_bucket()
                for index in range(len(weights)):
                    name, tensor = weights[index]
                    weights[index] = None  # type: ignore[call-overload]
                    complete = last and index == len(weights) - 1
                    if complete and session.is_bucket_view(tensor):
                        # A for-loop still holds this tensor when it asks for the end (which releases the
                        # bucket); handing out a copy lets the release happen without a dangling view.
                        tensor = tensor.clone()
                    yielded += 1
                    yield name, tensor
                    name = tensor = None  # type: ignore[assignment]
                weights = None  # type: ignore[assignment]
                session.bucket_consumed(last)
                if last:
                    self.last_stats = session.stats()
                    return
        except GeneratorExit:
            name = tensor = weights = None  # type: ignore[assignment]
            if complete:  # closed after the last tensor: a normal end
                session.bucket_consumed(True)
                self.last_stats = session.stats()
            else:
                session.fail(f"iter_weights() was closed after {yielded} tensors, before the last bucket")
        except BaseException as exc:  # also KeyboardInterrupt / SystemExit thrown in at a yield
            name = tensor = weights = None  # type: ignore[assignment]
            session.fail(f"receiver gave up after {yielded} tensors: {type(exc).__name__}: {exc}", cause=exc)
            raise
        finally:
            self._end(session)


class BucketedWeightReceiver(ReceiverChannel):
    """The receiver's documented name and signature, kept: a ``ReceiverChannel`` (connects to a sender's
    ``endpoint`` and receives one sync per ``receive()`` / ``iter_weights()``). Keep it across syncs and close it
    (``close()`` or ``with``) when done."""


def _close_connection(pid: int, sock: zmq.Socket, watch: PeerWatch, context: zmq.Context) -> None:
    """Close a channel's socket, its watch and its context (only in the process that opened them)."""
    if os.getpid() != pid:
        return
    close_watched(sock, watch)
    context.term()


def _without_locals(exc: BaseException) -> BaseException:
    """``exc``, kept as a cause, with the locals of its finished frames (and its causes' and contexts') dropped: the
    loader's frames hold views of the bucket, which must not outlive the release; their lines stay in the traceback."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)  # (a frame still running, ours, is left as it is)
        current = current.__cause__ or current.__context__
    return exc


# -- One receiving session of a ``BucketedWeightReceiver``: map the bucket once, hand out views, release, ACK ---


log = logging.getLogger("refitkit.transfer._ipc.receiver")  # one logger for the receiver side (tests filter on it)


class ReceiveState(enum.Enum):
    """Where one receiving session stands (one state, changed only by ``to``)."""

    HANDSHAKE = "handshake"  # hello sent: waiting for the setup, mapping what it offers
    STREAMING = "streaming"  # ready sent: buckets are handed out
    DRAINING = "draining"  # the last bucket was consumed: releasing before the final ACK
    RELEASED = "released"  # every view and mapping let go (or found kept); the sender not answered yet
    ACKED = "acked"  # the final ACK went out: the session ended as it should
    FAILED = "failed"  # released, then the error reported to the sender (best effort)
    ABORTED = "aborted"  # the sender refused or aborted the session; released, and the abort answered

    @property
    def phase(self) -> SessionPhase:
        """The protocol phase this state belongs to, as messages name it."""
        return _RECEIVE_PHASE_OF[self]

    @property
    def released(self) -> bool:
        """Whether the session's views and mappings were let go (nothing left to release)."""
        return self in (ReceiveState.RELEASED, ReceiveState.ACKED, ReceiveState.FAILED, ReceiveState.ABORTED)

    @property
    def ended(self) -> bool:
        """Whether the sender was given the session's last word (final ACK, error, or the abort's answer)."""
        return self in (ReceiveState.ACKED, ReceiveState.FAILED, ReceiveState.ABORTED)

    def to(self, new: ReceiveState) -> ReceiveState:
        """``new``, if this state may become it; else TransferError (a bug in refitkit)."""
        if new not in _RECEIVE_NEXT[self]:
            raise TransferError(f"receive session cannot go from {self.value!r} to {new.value!r}")
        return new


_RECEIVE_PHASE_OF = {
    ReceiveState.HANDSHAKE: SessionPhase.HANDSHAKE,
    ReceiveState.STREAMING: SessionPhase.STREAMING,
    ReceiveState.DRAINING: SessionPhase.DRAINING,
    ReceiveState.RELEASED: SessionPhase.DRAINING,  # (for the sender the session drains until it is answered)
    ReceiveState.ACKED: SessionPhase.RELEASED,
    ReceiveState.FAILED: SessionPhase.RELEASED,
    ReceiveState.ABORTED: SessionPhase.RELEASED,
}
_RECEIVE_NEXT: dict[ReceiveState, frozenset[ReceiveState]] = {
    ReceiveState.HANDSHAKE: frozenset({ReceiveState.STREAMING, ReceiveState.RELEASED, ReceiveState.ABORTED}),
    ReceiveState.STREAMING: frozenset({ReceiveState.DRAINING, ReceiveState.RELEASED}),
    ReceiveState.DRAINING: frozenset({ReceiveState.RELEASED}),
    ReceiveState.RELEASED: frozenset({ReceiveState.ACKED, ReceiveState.FAILED, ReceiveState.ABORTED}),
    ReceiveState.ACKED: frozenset(),
    ReceiveState.FAILED: frozenset(),
    ReceiveState.ABORTED: frozenset(),
}


class _ReceiveSession:
    """State of one sync on a ``ReceiverChannel``: mapping, sequence numbers, partly assembled tensors. The socket
    and its watch are the channel's: used here, closed there."""

    def __init__(
        self,
        *,
        endpoint: str,
        sock: zmq.Socket,
        watch: PeerWatch,
        device: torch.device,
        timeout_s: float,
        max_sync_s: float,
        plans: dict[int, _DirectPlan],
    ) -> None:
        self.endpoint, self.timeout_s, self.max_sync_s = endpoint, timeout_s, max_sync_s
        self.plans = plans  # the channel's direct buckets as laid out last time, by sequence number
        self.device = device
        self.state = ReceiveState.HANDSHAKE
        self.sock: zmq.Socket | None = sock  # (None once the sync ended: nothing more goes out for it)
        self.watch = watch  # the socket's connection: whether the sender is still there
        self.exchange = secrets.token_hex(8)  # this sync's hello: answers to others' (earlier syncs') are dropped
        self.session: str | None = None
        self.mapping: shm.ShmMapping | cuda_ipc.CudaIpcMapping | None = None
        self.exported: list[
            cuda_ipc.CudaIpcMapping
        ] = []  # the sender's own allocations (direct buckets), in index order
        self.inbox: deque[dict[str, Any]] = deque()  # frames that arrived ahead of the one being waited for
        self.packed = 0  # buckets the sender announced as complete
        self.unconsumed: deque[tuple[int, Any]] = deque()  # (seq, CUDA event or None) not announced done yet
        self.own_work = handoff.OwnWork()  # the wait for the oldest of them
        self.half_bytes = 0
        self.transport = "none"
        self.bucket_later = False  # a direct session whose bucket is announced with the first bucket that uses it
        self.device_fixed = False  # a CUDA mapping set self.device (all later ones must be on it)
        self.seq = 0
        self.partial: tuple[SplitProgress, torch.Tensor] | None = None  # the split tensor being assembled
        self.streams: dict[int, Any] = {}  # the loader's own streams (wait_on), waited for like the current one
        # The bucket being read lies in memory the sender keeps as it is until the session ends ("kept" direct
        # buckets): its consumption is announced when its reads are issued, not when they ran (the release waits
        # for them).
        self.kept_bucket = False
        self.assembled: list[torch.Tensor] = []  # this bucket's reassembled (owned) tensors
        self.started = time.perf_counter()
        self.sync_deadline = self.started + max_sync_s
        # seconds per phase (the receiver's last_timings_s): frames and packed are waits for the sender, map opens
        # its allocations, release_* split the release (the stream's reads, closing mappings, torch's caches)
        self.timings = dict.fromkeys(RECEIVE_PHASES, 0.0)
        self.wait_s = 0.0
        self.bytes = 0
        self.tensors = 0

    @property
    def phase(self) -> SessionPhase:
        """The protocol phase the session is in, as messages name it."""
        return self.state.phase

    # -- handshake --------------------------------------------------------------------------------

    def open(self) -> None:
        began = time.perf_counter()
        try:
            self._open()
        finally:
            self.timings["handshake"] += time.perf_counter() - began

    def _open(self) -> None:
        self.watch.follow(None, f"the sender on {self.endpoint!r}")
        hello: dict[str, Any] = {
            "pid": os.getpid(),
            "device": self.device.type,
            "timeout_s": self.timeout_s,  # how long a sender may keep this hello queued
            "pidns": shm.pid_namespace(),  # the same as the sender's: sealed memfds instead of named segments
            "exchange": self.exchange,  # echoed by the setup (or refusal) that answers this hello
        }
        if self.device.type == "cuda":
            hello["device_uuid"] = cuda_ipc.device_uuid(self.device)
        self.sock.send(encode("hello", **hello))
        setup = self._bounded(self._await_setup)
        if setup["kind"] == "abort":
            self.state = self.state.to(ReceiveState.ABORTED)  # (nothing was mapped)
            raise TransferError(f"sender on {self.endpoint!r} refused the session: {setup.get('reason')}")
        expect(setup, "setup")
        if type(setup.get("session")) is str:  # so that even a bad setup is answered with an error frame
            self.session = setup["session"]
        self.watch.follow_process(setup.get("pid"), setup.get("pidns"))
        try:
            self.session, transport, self.half_bytes, handle, self.bucket_later = setup_fields(setup)
            self.transport = transport
            if transport == "shm":
                self.mapping = shm.ShmMapping(handle, self.device)
            elif transport == "cuda_ipc":
                if self.device.type != "cuda":
                    raise TransferError(f"sender chose cuda_ipc but this receiver is on {self.device}")
                if not self.bucket_later:
                    self._map_cuda_bucket(handle)
            elif transport != "none":
                raise ProtocolError(f"unknown transport {brief(transport)} in setup")
            if transport == "shm":  # both sides hold mappings now: no crash can leak the name
                shm.unlink_quietly(handle.get("path"))
            if self.mapping is not None:
                self._check_halves_fit()
        except Exception as exc:
            self.fail(f"could not map the bucket: {exc}")
            raise
        self.sock.send(encode("ready", session=self.session))
        self.state = self.state.to(ReceiveState.STREAMING)

    def _await_setup(self, timeout_s: float) -> dict[str, Any]:
        """The setup (or refusal) that answers this sync's hello, within ``timeout_s``. Frames left on the channel's
        connection by an earlier sync (its sender's late frames, an answer to a hello that gave up) are dropped."""
        deadline = time.monotonic() + timeout_s
        left_s = timeout_s
        while True:
            try:
                frame = self._recv("setup", left_s)
            except PeerGone:
                raise
            except TransferTimeout as exc:  # named with the whole wait's bound, not what was left of it
                raise timeout_error(self.phase, "setup", f"the sender on {self.endpoint!r}", timeout_s) from exc
            if frame["kind"] in ("setup", "abort") and frame.get("exchange") == self.exchange:
                return frame
            left_s = max(0.0, deadline - time.monotonic())
            log.debug("receiver on %r dropped a %s frame of an earlier sync", self.endpoint, frame["kind"])

    def _map_cuda_bucket(self, handle: dict[str, Any]) -> None:
        began = time.perf_counter()
        self.mapping = cuda_ipc.CudaIpcMapping(handle, self.device)
        self.timings["map"] += time.perf_counter() - began
        self._adopt_device(self.mapping, "the bucket")

    def _adopt_device(self, mapping: cuda_ipc.CudaIpcMapping, what: str) -> None:
        """The session reads on the device of its first mapping; every later one must lie on that device too (the
        release synchronizes one device's stream before it closes them all)."""
        if self.device_fixed and mapping.device != self.device:
            raise ProtocolError(f"{what} lies on {mapping.device}; this session's other mappings are on {self.device}")
        self.device, self.device_fixed = mapping.device, True

    def _check_halves_fit(self) -> None:
        buffer_bytes = self.mapping.tensor.numel()  # type: ignore[union-attr]
        if not (0 < self.half_bytes and self.half_bytes % ALIGN_BYTES == 0 and 2 * self.half_bytes <= buffer_bytes):
            raise ProtocolError(f"setup: half_bytes={self.half_bytes} does not fit a {buffer_bytes}-byte bucket buffer")

    def _map_late_bucket(self, handle: Any) -> None:
        """The bucket of a direct session, announced with the first bucket that uses it: map it now."""
        if not self.bucket_later or self.mapping is not None or type(handle) is not dict:
            raise ProtocolError(
                f"bucket {self.seq} announces a bucket handle {brief(handle)}, but this session's bucket "
                + ("is mapped already" if self.mapping is not None else "was not announced as coming later")
            )
        self._map_cuda_bucket(handle)
        self._check_halves_fit()

    # -- buckets ----------------------------------------------------------------------------------

    def next_bucket(self) -> tuple[list[tuple[str, torch.Tensor]], bool]:
        """Wait for the next bucket frame, then for its bytes, and turn it into (name, tensor) pairs."""
        frame = self._next_frame(f"bucket {self.seq}")
        expect(frame, "bucket", session=self.session)
        half, wide, last = bucket_fields(frame, self.seq)
        if "direct" in frame:
            if "handle" in frame:
                raise ProtocolError(
                    f"direct bucket {self.seq} also announces a bucket handle (only a packed bucket may)"
                )
            return self._direct_bucket(frame, last), last
        if "handle" in frame:
            self._map_late_bucket(frame["handle"])
        entries = entries_from_wire(
            frame.get("entries") or [], capacity=2 * self.half_bytes if wide else self.half_bytes
        )
        if not entries:
            check_split_pieces(entries, self.partial[0] if self.partial else None, last=last)
            return [], last
        self._check_entries(entries, last)  # before any byte is read or any view exists
        self._wait_packed()
        return self._unpack(entries, 0 if wide else half * self.half_bytes), last

    def _direct_bucket(self, frame: dict[str, Any], last: bool) -> list[tuple[str, torch.Tensor]]:
        """A bucket whose tensors lie in the sender's own allocations: map the ones it exports first, then views.

        Its entries are checked and laid out once (a ``_DirectPlan``); a bucket that comes again as it came in
        the receiver's previous session (same entries, allocations and sizes: a held model's next sync) reuses
        that plan, checked against the same numbers, so only its views are made anew."""
        if self.device.type != "cuda" or self.transport != "cuda_ipc":
            raise ProtocolError(
                f"a direct bucket in a session whose transport is not cuda_ipc (receiver on {self.device})"
            )
        raw = frame.get("entries") or []
        sizes = [mapping.tensor.numel() for mapping in self.exported]  # type: ignore[union-attr]
        exports, raw_allocs, announced = direct_header(
            frame["direct"], count=len(raw) if type(raw) is list else -1, sizes=sizes
        )
        plan = self.plans.get(self.seq)
        if plan is None or not plan.fits(raw, raw_allocs, announced):
            entries = entries_from_wire(raw, capacity=MAX_TENSOR_BYTES)
            allocs = direct_allocs(entries, raw_allocs, announced)
            check_split_pieces(
                entries, self.partial[0] if self.partial else None, last=last
            )  # whole entries: no progress
            plan = self.plans[self.seq] = _DirectPlan(raw, raw_allocs, announced, entries, allocs)
        elif self.partial is not None:  # (whole entries and nothing in flight pass as they did before)
            check_split_pieces(plan.entries, self.partial[0], last=last)
        self.kept_bucket = frame["direct"].get("kept") is True
        self._map_exports(exports)
        self._wait_packed()
        self.assembled.clear()
        weights = plan.views([mapping.tensor for mapping in self.exported])  # type: ignore[misc]
        self.bytes += plan.nbytes
        self.tensors += len(weights)
        return weights

    def _map_exports(self, exports: list[dict[str, Any]]) -> None:
        """Map the sender's allocations ``exports`` announces (in index order, after those mapped before)."""
        began = time.perf_counter()
        for handle in exports:  # each announced size checked against the driver's size of what it maps
            self.exported.append(cuda_ipc.CudaIpcMapping(handle, self.device))
            self._adopt_device(self.exported[-1], f"exported allocation {len(self.exported) - 1}")
        self.timings["map"] += time.perf_counter() - began

    def _next_frame(self, waiting_for: str) -> dict[str, Any]:
        """The next frame of the stream, blocking on the socket; finished reads are announced while waiting."""
        began = time.perf_counter()
        watch: PeerWatch = self.watch  # type: ignore[assignment]

        def ready() -> bool:
            self._announce_consumed()
            if not self.inbox and watch.poll(0):
                self._take(self._recv_now())
            return bool(self.inbox)

        def wait(timeout_s: float) -> None:
            def look(left_s: float) -> None:
                if watch.lost:  # seen by an earlier look, and ready() found nothing since
                    raise self._gone(waiting_for)
                if self.unconsumed and not watch.poll(0):  # nothing from the sender yet: our reads end first
                    self.own_work.wait(self.unconsumed, left_s=left_s, timeout_s=self.timeout_s, phase=self.phase)
                    return
                # else the socket (and the sender's connection) until the deadline
                if watch.poll(0 if self.unconsumed else handoff.poll_ms(left_s)):
                    self._take(self._recv_now())

            handoff.wait_until(
                ready,
                look,
                timeout_s=timeout_s,
                phase=self.phase,
                waiting_for=waiting_for,
                peer=f"the sender on {self.endpoint!r}",
            )

        try:
            self._bounded(wait)
            return self.inbox.popleft()
        finally:
            waited = time.perf_counter() - began
            self.wait_s += waited
            self.timings["frames"] += waited

    def _wait_packed(self) -> None:
        """Wait until the sender announced this bucket's bytes as complete (its ``packed`` frame), blocking on the
        socket."""
        target = self.seq + 1
        if self.packed >= target:
            return

        def ready() -> bool:
            self._announce_consumed()
            return self.packed >= target

        watch: PeerWatch = self.watch  # type: ignore[assignment]
        waiting_for = f"bucket {self.seq} from the sender (its frame came, its bytes never completed)"

        def look(left_s: float) -> None:
            if watch.lost:  # seen by an earlier look, and ready() found nothing since
                raise self._gone(waiting_for)
            if self.unconsumed and not watch.poll(0):  # nothing from the sender yet: our reads end first
                self.own_work.wait(self.unconsumed, left_s=left_s, timeout_s=self.timeout_s, phase=self.phase)
                return
            if watch.poll(0 if self.unconsumed else handoff.poll_ms(left_s)):
                self._take(self._recv_now())
            for _ in range(FRAMES_PER_LOOK):  # an abort, or early frames (a flood cannot hold the wait)
                if not watch.poll(0):
                    break
                self._take(self._recv_now())

        def wait(timeout_s: float) -> None:
            handoff.wait_until(
                ready,
                look,
                timeout_s=timeout_s,
                phase=self.phase,
                waiting_for=waiting_for,
                peer=f"the sender on {self.endpoint!r}",
            )

        began = time.perf_counter()
        try:
            self._bounded(wait)
        finally:
            waited = time.perf_counter() - began
            self.wait_s += waited
            self.timings["packed"] += waited

    def _take(self, frame: dict[str, Any]) -> None:
        """File a frame that arrived: an abort ends the session here, ``packed`` counts, others wait in the inbox."""
        kind = frame["kind"]
        if frame.get("session") != self.session:  # left on the channel by an earlier sync
            log.debug("receiver on %r dropped a %s frame of an earlier sync", self.endpoint, kind)
            return
        if kind == "abort":
            reason = str(frame.get("reason"))
            self._release()
            self._send(encode("released", session=self.session, seq=self.seq), quiet=True)
            self.state = self.state.to(ReceiveState.ABORTED)
            raise TransferError(
                f"sender on {self.endpoint!r} aborted the session at bucket {self.seq} ({self._applied()}): {reason}"
            )
        if kind == "packed":
            expect(frame, "packed", session=self.session)
            seq = frame.get("seq")
            # (the sender has at most MAX_IN_FLIGHT buckets out beyond the ones consumed: two halves, two direct)
            if type(seq) is not int or seq != self.packed or seq >= self.seq + MAX_IN_FLIGHT:
                raise ProtocolError(
                    f"packed frame for bucket {brief(seq)}, expected bucket {self.packed} (reading {self.seq})"
                )
            self.packed += 1
            return
        self.inbox.append(frame)

    def _applied(self) -> str:
        """What a session that ends now, before its last bucket, leaves applied."""
        if not self.seq:
            return "nothing was handed to on_bucket"
        return (
            f"the weights are INCOMPLETE: {self.seq} buckets ({self.tensors} tensors) were already handed to on_bucket "
            "and applied; no bucket came with is_last=True"
        )

    def _gone(self, waiting_for: str) -> PeerGone:
        """The error of a wait that the sender's death (its connection's end) cut short."""
        return PeerGone(f"{self.watch.gone(self.phase, waiting_for)} ({self._applied()})")  # type: ignore[union-attr]

    def _bounded(self, wait: Callable[[float], T]) -> T:
        """``wait(timeout_s)`` with the wait's bound: ``timeout_s``, or what is left of the session's (``max_sync_s``,
        hello to final ACK), TransferTimeout naming that knob when it is the one that ran out."""
        left_s = self.sync_deadline - time.perf_counter()
        if left_s > 0:
            try:
                return wait(min(self.timeout_s, left_s))
            except PeerGone:
                raise
            except TransferTimeout:
                if self.timeout_s <= left_s:
                    raise
        raise TransferTimeout(
            f"{self.phase.value}: the session with the sender on {self.endpoint!r} took longer than "
            f"max_sync_s={self.max_sync_s:g}, at bucket {self.seq} ({self._applied()}); raise max_sync_s if a sync "
            "really takes this long"
        )

    def _announce_consumed(self) -> None:
        """A ``done`` frame for every bucket whose reads have finished, in order."""
        if self.unconsumed:
            handoff.announce_finished(
                self.unconsumed, lambda seq: self._send(encode("done", session=self.session, seq=seq))
            )

    def _check_entries(self, entries: list[Entry], last: bool) -> None:
        """The split tensor's pieces in order and consistent, and its size one this device can hold."""
        if self.mapping is None:
            raise ProtocolError("bucket with tensors in a session without a bucket buffer")
        check_split_pieces(entries, self.partial[0] if self.partial else None, last=last)
        for entry in entries:
            if entry.start == 0 and not entry.whole:
                check_split_fits(entry, self.device)

    def _unpack(self, entries: list[Entry], bucket_offset: int) -> list[tuple[str, torch.Tensor]]:
        """Views of the bucket for whole tensors; split ones are copied into place (and handed out once complete)."""
        if self.mapping is None:
            raise ProtocolError("bucket with tensors in a session without a bucket buffer")
        # Whole ALIGN_BYTES blocks, so the bucket can be seen as any dtype (the bucket's size is a multiple).
        used = align_up(max(entry.offset + entry.nbytes for entry in entries))
        self.assembled.clear()
        base = self.mapping.bucket(bucket_offset, used)
        typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}  # the bucket seen as each dtype, and where it starts
        weights = []
        try:
            for entry in entries:
                if entry.whole:
                    dtype = entry.dtype
                    if dtype not in typed:
                        view = base.view(dtype)
                        typed[dtype] = (view, view.storage_offset())
                    view, first = typed[dtype]
                    element = first + entry.offset // dtype.itemsize
                    weights.append((entry.name, view.as_strided(entry.shape, contiguous_strides(entry.shape), element)))
                else:
                    tensor = self._assemble(entry, base[entry.offset : entry.offset + entry.nbytes])
                    if tensor is not None:
                        weights.append((entry.name, tensor))
                        self.assembled.append(tensor)
                self.bytes += entry.nbytes
        except BaseException:
            base = view = typed = weights = None  # type: ignore[assignment]  # the traceback must not pin the bucket
            raise
        self.tensors += len(weights)
        return weights

    def _assemble(self, entry: Entry, piece: torch.Tensor) -> torch.Tensor | None:
        """Copy one byte range of a split tensor into place; the tensor once its last range arrived
        (the ranges were checked by ``_check_entries``)."""
        if entry.start == 0:
            try:
                tensor = torch.empty(entry.shape, dtype=entry.dtype, device=self.device)
            except RuntimeError as exc:  # out of memory, typically: name what could not be held
                raise TransferError(
                    f"{entry.name!r}: cannot allocate {entry.total} bytes on {self.device} to reassemble it: {exc}"
                ) from exc
        else:
            tensor = self.partial[1]  # type: ignore[index]
        tensor.view(-1).view(torch.uint8)[entry.start : entry.start + entry.nbytes].copy_(piece)
        if not entry.completes:
            self.partial = (SplitProgress(entry.name, entry.dtype, entry.shape, entry.start + entry.nbytes), tensor)
            return None
        self.partial = None
        return tensor

    def is_bucket_view(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` points into the mapped bucket (rather than being reassembled and owned)."""
        return not any(tensor is assembled for assembled in self.assembled)

    def bucket_consumed(self, last: bool) -> None:
        """The caller dropped this bucket's tensors: free its half once the reads finished, or release and ACK."""
        if not last:
            # A CUDA loader's copies out of the bucket are queued on this stream (and on those it handed to
            # wait_on, which this one now waits for): announce when they ran (a kept bucket: now).
            stream = self._reads_stream()
            kept, self.kept_bucket = self.kept_bucket, False
            self.unconsumed.append((self.seq, None if kept else handoff.event_after(stream)))  # (in order)
            self._announce_consumed()
            self.seq += 1
            return
        self.state = self.state.to(ReceiveState.DRAINING)
        try:
            self._release(final=True)
        except TransferError as exc:
            self.fail(str(exc))
            raise
        self._send(encode("released", session=self.session, seq=self.seq))
        self.state = self.state.to(ReceiveState.ACKED)

    def _reads_stream(self) -> Any:
        """The current CUDA stream, made to wait for the loader's streams (wait_on); None on the CPU."""
        if self.device.type != "cuda":
            return None
        stream = torch.cuda.current_stream(self.device)
        for side in self.streams.values():
            stream.wait_stream(side)
        return stream

    # -- release, failure, frames -----------------------------------------------------------------

    def _release(self, final: bool = False) -> None:
        """Drop views and the mapping; ``final``: the last bucket was consumed (the final ACK follows)."""
        if self.state.released:
            return
        self.state = self.state.to(ReceiveState.RELEASED)
        began = time.perf_counter()
        self.partial = None
        self.assembled.clear()
        self.unconsumed.clear()
        mapping, self.mapping = self.mapping, None
        exported, self.exported = self.exported, []
        try:
            if mapping is not None or exported:
                self._reads_stream()
                if isinstance(mapping, shm.ShmMapping):
                    mapping.release()  # finishes this stream's reads (and so the loader's streams') first
                else:  # the CUDA IPC bucket (if any) and the sender's own allocations (direct buckets)
                    named = {
                        "the CUDA IPC bucket": [] if mapping is None else [mapping],
                        "the sender's exported allocations": exported,
                    }
                    cuda_ipc.release_mappings(
                        [m for ms in named.values() for m in ms],
                        what=" or ".join(what for what, ms in named.items() if ms),
                        timings=self.timings,
                    )
            elif self.device.type == "cuda":
                torch.cuda.empty_cache()
            if final:
                # Release strictly before the final ACK: an ACK first lets the sender free memory still mapped here.
                log.debug("bucket memory released", extra={"refit_event": "receiver_released"})
                log.debug("sending the final ACK", extra={"refit_event": "final_ack_sending"})
        finally:
            self.timings["release"] += time.perf_counter() - began

    def fail(self, message: str, *, cause: BaseException | None = None) -> None:
        """Release, then tell the sender why this session failed, with ``cause``'s type, message and last frames
        as data (best effort; once per session)."""
        if self.state.ended:
            return
        phase = self.phase  # where it failed (the release below moves on)
        try:
            self._release()
        except TransferError as exc:
            message = f"{message}; and then {exc}"
        if self.session is not None:
            fields = failure_fields(cause) if cause is not None else {}
            frame = encode("error", session=self.session, phase=phase.value, message=message, **fields)
            self._send(frame, quiet=True)
        self.state = self.state.to(ReceiveState.FAILED)

    def stats(self) -> TransferStats:
        return TransferStats(
            bytes=self.bytes,
            tensors=self.tensors,
            buckets=self.seq + 1,
            seconds=time.perf_counter() - self.started,
            ack_wait_s=self.wait_s,
        )

    def close(self) -> None:
        """Release whatever is still held; never raises for the release."""
        began = time.perf_counter()
        self.partial = None
        self.assembled.clear()
        try:
            self._release()
        except TransferError as exc:
            log.warning("receiver on %r: %s", self.endpoint, exc)
        self.sock = None  # the channel's, and kept by it for its next sync
        self.watch.unfollow()
        self.timings["close"] += time.perf_counter() - began

    def _send(self, payload: bytes, *, quiet: bool = False) -> None:
        if self.sock is None:
            if quiet:
                return
            raise TransferError(f"{self.phase.value}: the receiver's socket to {self.endpoint!r} is closed")
        try:
            self.sock.send(payload, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if not quiet:
                raise TransferError(f"{self.phase.value}: cannot reach the sender on {self.endpoint!r}: {exc}") from exc

    def _recv_now(self) -> dict[str, Any]:
        """A frame that poll() said is there."""
        return self._recv("a frame", timeout_s=0.0)

    def _recv(self, waiting_for: str, timeout_s: float | None = None) -> dict[str, Any]:
        if self.watch is None:
            raise TransferError(f"{self.phase.value}: the receiver's socket to {self.endpoint!r} is closed")
        began = time.perf_counter()
        try:
            parts = recv_frame(
                self.watch,
                timeout_s=self.timeout_s if timeout_s is None else timeout_s,
                phase=self.phase,
                waiting_for=waiting_for,
                peer=f"the sender on {self.endpoint!r}",
            )
        finally:
            self.wait_s += time.perf_counter() - began
        if len(parts) != 1:
            raise ProtocolError(f"{self.phase.value}: a {len(parts)}-part message from {self.endpoint!r}")
        return decode(parts[0])


class _DirectPlan:
    """A direct bucket's checked entries and how its views lie in the sender's allocations, kept by the receiver to
    lay out the same bucket of its next session without parsing and checking it again (``fits``).

    Same-shaped tensors spaced evenly in one allocation (a model's layers repeat, so each projection's weights do)
    come from one strided view split by ``unbind``: one call for the run instead of an ``as_strided`` per tensor
    (about 3 us each on the H200 machine's host, with the parsing most of the receiver's time per tensor)."""

    def __init__(
        self, raw: list[Any], raw_allocs: list[Any], announced: list[int], entries: list[Entry], allocs: list[int]
    ) -> None:
        self.raw, self.raw_allocs, self.announced = raw, raw_allocs, announced  # what it was made from, as it came
        self.entries = entries
        self.names = [entry.name for entry in entries]
        self.nbytes = sum(entry.nbytes for entry in entries)
        members: dict[tuple[int, torch.dtype, tuple[int, ...]], list[tuple[int, int]]] = {}  # -> (position, element)
        for position, (entry, index) in enumerate(zip(entries, allocs)):
            members.setdefault((index, entry.dtype, entry.shape), []).append(
                (position, entry.offset // entry.dtype.itemsize)
            )
        # (allocation, dtype, size, stride, first element, positions): a run's view, whose unbind gives its tensors
        # (a tensor of its own: its view)
        self.runs: list[tuple[int, torch.dtype, tuple[int, ...], tuple[int, ...], int, list[int]]] = []
        for (index, dtype, shape), found in members.items():
            strides = contiguous_strides(shape)
            for run in _even_runs(found):
                if len(run) == 1:  # a tensor of its own: its view directly
                    self.runs.append((index, dtype, shape, strides, run[0][1], [run[0][0]]))
                else:
                    step = run[1][1] - run[0][1]
                    self.runs.append(
                        (index, dtype, (len(run), *shape), (step, *strides), run[0][1], [p for p, _ in run])
                    )

    def fits(self, raw: Any, raw_allocs: list[Any], announced: list[int]) -> bool:
        """Whether a bucket with these entries, allocations and allocation sizes (as they came) is this one."""
        return raw == self.raw and raw_allocs == self.raw_allocs and announced == self.announced

    def views(self, allocations: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """(name, view) of every entry, in the bucket's order, into ``allocations`` (the bytes of the session's
        mappings, by index)."""
        names = self.names
        weights: list[Any] = [None] * len(names)
        typed: dict[
            tuple[int, torch.dtype], tuple[torch.Tensor, int]
        ] = {}  # (allocation, dtype) -> view, first element
        try:
            for index, dtype, size, stride, element, positions in self.runs:
                key = (index, dtype)
                if key not in typed:
                    whole = allocations[index]  # whole ALIGN_BYTES blocks: seen as any dtype
                    view = whole[: len(whole) // ALIGN_BYTES * ALIGN_BYTES].view(dtype)  # type: ignore[index, arg-type]
                    typed[key] = (view, view.storage_offset())
                view, first = typed[key]
                if len(positions) == 1:
                    weights[positions[0]] = (names[positions[0]], view.as_strided(size, stride, first + element))
                    continue
                for position, tensor in zip(positions, view.as_strided(size, stride, first + element).unbind(0)):
                    weights[position] = (names[position], tensor)
        except BaseException:
            whole = view = typed = weights = None  # type: ignore[assignment]  # the traceback must not pin a mapping
            raise
        return weights


def _even_runs(found: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """``found`` ((position, element) of same-shaped tensors, in order) as runs whose elements step evenly upward:
    one run, or two or three interleaved ones (a layer's gate and up projections share a shape), else one each."""
    for ways in (1, 2, 3):
        if len(found) <= ways:
            break
        runs = [found[start::ways] for start in range(ways)]
        if all(_steps_evenly(run) for run in runs):
            return runs
    return [[one] for one in found]


def _steps_evenly(run: list[tuple[int, int]]) -> bool:
    if len(run) < 2:
        return True
    step = run[1][1] - run[0][1]
    return step > 0 and all(later[1] - earlier[1] == step for earlier, later in zip(run, run[1:]))
