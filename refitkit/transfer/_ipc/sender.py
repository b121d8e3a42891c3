"""The trainer side of a weight sync: stream (name, tensor) pairs through a double-buffered bucket.

One ``send()`` is one session: wait for a receiver's hello, allocate the bucket buffer (two halves
of ``bucket_bytes // 2``; a list or tuple that needs less gets less: the buffer is allocated and
freed every session, and freeing 2 GiB took 1.2-2.4 ms inside a session on the H200, 1.1 GiB
0.65-1.0 ms; a CUDA buffer whose device is known up front is allocated while the hello is on its
way), let the receiver map it once (buckets are packed and their frames queued
meanwhile), stream buckets, and wait for the final ACK that the receiver sends only after it
released every view and its mapping. A bucket's frame leaves as soon as its copies are issued; its
bytes are announced when the copies finished (a ``packed`` frame), and its half is reused once the receiver
announced it done reading (a ``done`` frame; ``handoff``). The bucket is freed in a ``finally``, so the sender
holds 0 bytes of bucket memory after every ``send()``, whether it succeeded or not. A receiver
whose hello arrives during a session is served by the next ``send()``.

A ``SenderChannel`` is the trainer rank's end of its link to an engine rank's ``ReceiverChannel``: it
owns its ZMQ context, its bound socket and the watch over its receivers' connections, from the constructor to
``close()``; each ``send()`` is one sync (exchange)
on it. The socket stays bound through failed syncs too: a hello said at any time is served. Each
sync's frames are told from others' by the receiver's connection and the sync's tokens (the
receiver's hello, the sender's session): anything else (a failed sync's late frames, garbage from
another process of our uid) is dropped and logged. The receiver's death is noticed by its connection (``liveness``): a wait of the
session raises ``PeerGone`` at once instead of waiting out ``timeout_s``.

Validation: a list or tuple is checked whole (names, dtypes, devices, duplicates, layout) before
the sender waits for a hello, so no receiver sees a byte of a bad list; ``send()`` raises
``InvalidInput`` at once, and a receiver already waiting is refused with an ``abort`` frame (as for
weights that are not an iterable at all). A generator is checked item by item as it is consumed.

Failure semantics: an invalid generator item, an exception from the caller's iterator (also
``KeyboardInterrupt`` or ``SystemExit``), or a cancelled ``asend()`` aborts the session: the
receiver gets an ``abort`` frame, releases, and raises ``TransferError`` saying the weights are
INCOMPLETE and how many buckets and tensors it had already handed to ``on_bucket``: those were
applied (a stream cannot be taken back), but it never sees ``is_last=True``, so a loader that
commits on the last bucket commits nothing. ``send()`` then re-raises the original error
(``InvalidInput`` for bad items) once the bucket is freed.

One session at a time: a sender's socket belongs to the thread running its session. A second
``send()`` / ``asend()`` waits for the running one (at most ``timeout_s``, then ``TransferError``);
a ``send()`` from inside the running session's own iterator is refused at once. A cancelled
``asend()`` stops its worker thread within a wait slice (a caller's sync iterator that blocks is
waited for), aborts the receiver, frees the bucket and lets the next session run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import functools
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import zmq
from torch._C._autograd import _profiler_enabled
from torch.profiler import record_function

from refitkit.errors import ChannelClosed, InvalidInput, PeerGone, ProtocolError, TransferError, TransferTimeout
from refitkit.transfer._ipc import cuda_ipc, handoff, shm
from refitkit.transfer._ipc.endpoint import (
    WaitingReceivers,
    bind_sender,
    remove_socket_file,
    socket_identity,
    socket_path,
)
from refitkit.transfer._ipc.liveness import FRAMES_PER_LOOK, PeerWatch, recv_frame
from refitkit.transfer.common import ChannelState, DirectSplit, SessionPhase, TransferStats, checked_knobs
from refitkit.transfer.packing import (
    BOTH_HALVES,
    BucketPacker,
    CheckedItem,
    check_item,
    check_items,
    fresh_each,
    half_bytes_for,
    held_unchanged,
)
from refitkit.transfer.protocol import (
    ALIGN_BYTES,
    DIRECT_IN_FLIGHT,
    DIRECT_MAX_TENSORS,
    brief,
    decode,
    encode,
    entry_to_wire,
    expect,
    remote_failure,
    timeout_error,
)

log = logging.getLogger(__name__)


class SendState(enum.Enum):
    """Where one ``send()`` session stands, as the sender sees it (one state, changed only by ``to``)."""

    AWAITING_HELLO = "awaiting hello"  # no setup sent: a receiver gone by now can be replaced by the next hello
    OFFERED = "offered"  # setup sent: the receiver may still be mapping the bucket; buckets queue meanwhile
    STREAMING = "streaming"  # the receiver said ready: it mapped the bucket
    DRAINING = "draining"  # every bucket sent; waiting for the final ACK (a late ready is still taken)
    RELEASED = "released"  # the final ACK: the receiver released every view and its mapping
    PEER_FAILED = "peer failed"  # the receiver reported an error (it released before reporting)
    ABORTED = "aborted"  # this side gave up; a live receiver was sent an abort frame

    @property
    def phase(self) -> SessionPhase:
        """The protocol phase this state belongs to, as messages name it."""
        return _PHASE_OF[self]

    @property
    def setup_sent(self) -> bool:
        """Whether the receiver may hold (or be making) a mapping of the bucket."""
        return self in (SendState.OFFERED, SendState.STREAMING, SendState.DRAINING)

    def to(self, new: SendState) -> SendState:
        """``new``, if this state may become it; else TransferError (a bug, or a peer breaking the protocol)."""
        if new not in _NEXT[self]:
            raise TransferError(f"send session cannot go from {self.value!r} to {new.value!r}")
        return new


_PHASE_OF = {
    SendState.AWAITING_HELLO: SessionPhase.HANDSHAKE,
    SendState.OFFERED: SessionPhase.STREAMING,
    SendState.STREAMING: SessionPhase.STREAMING,
    SendState.DRAINING: SessionPhase.DRAINING,
    SendState.RELEASED: SessionPhase.RELEASED,
    SendState.PEER_FAILED: SessionPhase.RELEASED,
    SendState.ABORTED: SessionPhase.RELEASED,
}
_NEXT: dict[SendState, frozenset[SendState]] = {
    SendState.AWAITING_HELLO: frozenset({SendState.OFFERED, SendState.ABORTED}),
    SendState.OFFERED: frozenset({SendState.STREAMING, SendState.DRAINING, SendState.PEER_FAILED, SendState.ABORTED}),
    SendState.STREAMING: frozenset({SendState.DRAINING, SendState.PEER_FAILED, SendState.ABORTED}),
    SendState.DRAINING: frozenset({SendState.RELEASED, SendState.PEER_FAILED, SendState.ABORTED}),
    SendState.RELEASED: frozenset(),
    SendState.PEER_FAILED: frozenset(),
    SendState.ABORTED: frozenset(),
}


class BucketState(enum.Enum):
    """How one session's memory reaches the receiver (one state, changed only by ``to``): the bucket with the setup,
    or in a direct session over CUDA IPC only once a tensor needs it (most syncs of a held model need none)."""

    WITH_SETUP = "with the setup"  # the bucket, if the session has one, is allocated by the set-up and offered in it
    LATER = "later"  # a direct session: no bucket until a tensor must go through one (the setup says so)
    LATE_PENDING = "allocated late"  # a tensor needed the bucket: its handle goes with the next packed bucket's frame
    ANNOUNCED = "announced"  # that frame went out

    @property
    def later(self) -> bool:
        """Whether the bucket is still to be allocated, should a tensor need it."""
        return self is BucketState.LATER

    def to(self, new: BucketState) -> BucketState:
        """``new``, if this state may become it; else TransferError (a bug in refitkit)."""
        if new not in _BUCKET_NEXT[self]:
            raise TransferError(f"send session's bucket cannot go from {self.value!r} to {new.value!r}")
        return new


_BUCKET_NEXT: dict[BucketState, frozenset[BucketState]] = {
    BucketState.WITH_SETUP: frozenset(),
    BucketState.LATER: frozenset({BucketState.WITH_SETUP, BucketState.LATE_PENDING}),
    BucketState.LATE_PENDING: frozenset({BucketState.ANNOUNCED}),
    BucketState.ANNOUNCED: frozenset(),
}

# pull, a list's checked items, all on CUDA, whether the items stay as they are during the session (``held_unchanged``),
# whether each is made for the sender (``fresh_each``)
_Prepared = tuple[Callable[[], Any], list[CheckedItem] | None, bool, bool, bool]


def _checked_hook(on_hello: Any) -> Callable[[], Any] | None:
    if on_hello is not None and not callable(on_hello):
        raise InvalidInput(f"on_hello={brief(on_hello)}; need a callable taking no arguments, or None")
    return on_hello


async def _anext_or_end(iterator: Any) -> Any:
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return END


DIRECT_MAX_ALLOCATIONS = 64  # more of the trainer's allocations than this in one sync: the rest go through the bucket
# A direct bucket ships once it names this many tensors or bytes (or the stream ends), so the receiver copies the
# first weights while the sender still walks the rest (at most protocol.DIRECT_IN_FLIGHT await the receiver at once).
DIRECT_SHIP_TENSORS = 64
DIRECT_SHIP_BYTES = 1 << 30


class SenderChannel:
    """Binds ``endpoint`` and sends weights to one receiver (normally the ``ReceiverChannel`` of the engine rank it
    is paired with) per ``send()``: one sync (exchange) a call, one at a time, until ``close()`` (or ``with``).
    Keep one channel across syncs. A channel belongs to the process that opened it: in a forked child every call
    raises ``ChannelClosed``.

    ``direct`` (the default; it applies to CUDA IPC sessions): the receiver reads each weight where the trainer
    holds it, one copy per byte instead of two: the sender exports the allocations that hold the weights (at
    most ``DIRECT_MAX_ALLOCATIONS`` a sync) and keeps them referenced until the receiver released every mapping.
    Only for sources whose tensors stay as they are during ``send()`` (a list or tuple, a module's
    ``named_parameters()``, a dict's ``items()``, an adapter's ``HeldWeights``) or that yield tensors made for
    the sender (an adapter's ``FreshWeights``, e.g. FSDP2's gathered weights: each is kept only until the
    receiver read it, so at most about ``bucket_bytes`` of them are alive at once); the rest, and tensors that
    are strided, unaligned or in memory the driver will not export, go through the bucket. ``last_split`` says
    how a session split. ``direct=False``: every weight through the bucket (two copies, the bucket allocated
    before the first byte).
    """

    def __init__(
        self,
        endpoint: str,
        bucket_bytes: int = 2 << 30,
        transport: str = "auto",
        timeout_s: float = 120.0,
        *,
        direct: bool = True,
    ) -> None:
        timeout_s, bucket_bytes, transport = checked_knobs(  # type: ignore[assignment]
            timeout_s=timeout_s, bucket_bytes=bucket_bytes, transport=transport, min_bucket_bytes=4 * ALIGN_BYTES
        )
        if not isinstance(direct, bool):
            raise InvalidInput(f"{type(self).__name__}: direct= must be a bool, got {direct!r}")
        if transport == "cuda_ipc" and not cuda_ipc.ipc_available():
            raise InvalidInput("transport='cuda_ipc' needs a CUDA GPU and the CUDA driver in the sender")
        self.endpoint = endpoint
        self.path = socket_path(endpoint)
        self.bucket_bytes = bucket_bytes
        self.half_bytes = bucket_bytes // 2 // ALIGN_BYTES * ALIGN_BYTES
        self.transport = transport
        self.timeout_s = timeout_s
        self.direct = direct
        self.last_split: DirectSplit | None = None  # with direct=True: how the last session split (direct / bucket)
        self._lock = threading.Lock()  # one session at a time: ZMQ sockets are not thread-safe
        self._owner: int | None = None  # the thread running the current session
        self._stop: StopRequest | None = None  # stops the current session (close() from another thread)
        self.state = ChannelState.OPEN
        self._pid = os.getpid()
        self.last_timings_s: dict[str, float] = {}  # per-phase seconds of the last session, for benchmarks
        self._waiting = WaitingReceivers()  # hellos that arrived during a session, for the next ones
        shm.remove_stale_segments()
        self._context: zmq.Context | None = None
        self._socket: zmq.Socket | None = None
        self._watch: PeerWatch | None = None  # the socket's connections: whether a session's receiver is still there
        self._open()

    # -- socket lifecycle -------------------------------------------------------------------------

    def _open(self) -> None:
        self._context = zmq.Context()
        try:
            self._socket, self._watch = bind_sender(self._context, self.path)
            self._bound = socket_identity(self.path)  # close() removes this file, not a successor's
        except Exception:
            self._context.term()
            self._context = None
            raise

    def close(self) -> None:
        """Close the socket (its file is removed); the sender cannot send afterwards.

        A ``send()`` running in another thread is stopped first (its receiver aborted, its bucket
        freed), bounded by ``timeout_s``; closing from inside the running ``send()`` is refused."""
        if self._owner == threading.get_ident():
            raise TransferError(
                f"close() on {self.endpoint!r} was called from inside its own running send() (the weights "
                "iterator?); close the sender after send() returns"
            )
        if self.state is ChannelState.CLOSED:
            return
        if os.getpid() != self._pid:  # a forked child: the socket, context and file are the parent's to close
            self.state = ChannelState.CLOSED
            self._socket = self._watch = self._context = None
            return
        self.state = ChannelState.CLOSED
        stop = self._stop
        if stop is not None:
            stop.stop("the sender was closed (close())")
        if not self._lock.acquire(timeout=self.timeout_s + 1.0):
            raise TransferError(
                f"close() on {self.endpoint!r}: the running send() did not stop within timeout_s={self.timeout_s:g}"
            )
        try:
            self._close_socket()
        finally:
            self._lock.release()

    def _close_socket(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._context is not None:
            self._context.term()  # returns once the listener is gone, so a rebind cannot race it
            self._context = None
            remove_socket_file(self.path, self._bound)  # libzmq leaves the file; a closed sender should not look stale

    def __enter__(self) -> SenderChannel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- public API -------------------------------------------------------------------------------

    def send(self, weights: Any, *, on_hello: Callable[[], Any] | None = None) -> TransferStats:
        """Send every (name, tensor) of a sync or async iterable; returns after the receiver released.

        ``on_hello``: called once, in the session's thread, when the session's receiver has said hello and the setup
        went out (with the first item pulled, before the second is): the point from which a receiver inside an
        engine's call is known to run it, so the caller may queue the engine's next call (a cache reset) behind it.
        Keep it short: the stream waits for it; what it raises fails the session as a bad item would."""
        on_hello = _checked_hook(on_hello)
        if hasattr(weights, "__aiter__"):
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return asyncio.run(self.asend(weights, on_hello=on_hello))
            raise InvalidInput(
                "send() got an async iterable inside a running event loop; use `await sender.asend(...)`"
            )
        return self._exclusive(lambda: self._prepare(weights), None, on_hello)

    async def asend(self, weights: Any, *, on_hello: Callable[[], Any] | None = None) -> TransferStats:
        """``send()`` for event loops: the session runs in a worker thread; async items are pulled on this loop;
        ``on_hello`` as in ``send()`` (called in that thread).

        Cancelling it (``task.cancel()``, ``asyncio.wait_for``) stops the session: the receiver is
        aborted and the bucket freed before the ``CancelledError`` propagates."""
        loop = asyncio.get_running_loop()
        on_hello = _checked_hook(on_hello)
        cancel = StopRequest()
        if hasattr(weights, "__aiter__"):
            iterator = weights.__aiter__()

            def pull() -> Any:
                future = asyncio.run_coroutine_threadsafe(_anext_or_end(iterator), loop)
                while True:  # in slices: a cancelled asend() must not leave this thread waiting on the loop
                    try:
                        return future.result(CANCEL_SLICE_S)
                    except concurrent.futures.TimeoutError:
                        if cancel.is_set():
                            future.cancel()
                            raise _Cancelled("asend() was cancelled while waiting for the next item") from None

            def prepare() -> _Prepared:
                return pull, None, False, False, False

        else:

            def prepare() -> _Prepared:
                return self._prepare(weights)

        work = loop.run_in_executor(None, self._exclusive, prepare, cancel, on_hello)
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            cancel.stop("asend() was cancelled")  # the worker aborts the receiver, frees the bucket, releases the lock
            # The worker's outcome is taken here, whenever it comes (also should this wait be cancelled in turn): the
            # caller gets the CancelledError, and no "Future exception was never retrieved" for its stop.
            work.add_done_callback(functools.partial(_outcome_of_cancelled, self.endpoint))
            await asyncio.wait([work])  # bounded: every wait of the session looks at ``cancel`` each slice
            raise

    # -- one session at a time --------------------------------------------------------------------

    def _exclusive(
        self, prepare: Callable[[], _Prepared], cancel: StopRequest | None, on_hello: Callable[[], Any] | None = None
    ) -> TransferStats:
        """Run one session holding the sender's lock (waiting for a running one at most ``timeout_s``)."""
        if self._owner == threading.get_ident():
            raise TransferError(
                f"send() on {self.endpoint!r} was called from inside its own running send() (the weights "
                "iterator?); one session at a time: send the weights after it returns"
            )
        deadline = time.monotonic() + self.timeout_s
        while not self._lock.acquire(timeout=CANCEL_SLICE_S):
            _raise_if_cancelled(cancel, "while waiting for another send() on this sender")
            if time.monotonic() >= deadline:
                raise TransferError(
                    f"another send() on {self.endpoint!r} held the sender for timeout_s={self.timeout_s:g}; a sender "
                    "runs one session at a time: wait for it, use another sender (endpoint), or raise timeout_s"
                )
        self._owner = threading.get_ident()
        self._stop = cancel = cancel if cancel is not None else StopRequest()
        try:
            if os.getpid() != self._pid:
                raise ChannelClosed(
                    f"the sender channel on {self.endpoint!r} was opened in process {self._pid}; this is process "
                    f"{os.getpid()} (a fork?): open a channel of its own here"
                )
            if self.state is ChannelState.CLOSED or self._socket is None:
                raise ChannelClosed(f"sender on {self.endpoint!r} is closed; open a new channel")
            _raise_if_cancelled(cancel, "before its session started")
            try:
                pull, listed, all_cuda, held, fresh = prepare()
            except InvalidInput as exc:
                self._refuse_waiting(f"the sender's weights were invalid: {exc}")
                raise
            return self._session(pull, listed, all_cuda, held, fresh, cancel, on_hello)
        finally:
            self._owner = self._stop = None
            self._lock.release()

    def _prepare(self, weights: Any) -> _Prepared:
        """(pull, the checked items of a list or tuple, whether they are all CUDA tensors, whether the items stay
        as they are during the session) for a sync iterable."""
        if isinstance(weights, (list, tuple)):
            checked, all_cuda = check_items(weights, need_cuda=self.transport == "cuda_ipc")
            items = iter(checked)
            return lambda: next(items, END), checked, all_cuda, True, False
        try:
            iterator = iter(weights)
        except TypeError as exc:
            raise InvalidInput(f"weights is a {type(weights).__name__}, not an iterable of (name, tensor)") from exc
        return lambda: next(iterator, END), None, False, held_unchanged(iterator), fresh_each(iterator)

    def _refuse_waiting(self, reason: str) -> None:
        """Send an abort to every receiver whose hello is already here, so none waits its timeout for nothing."""
        if self._socket is None:
            return
        while self._socket.poll(0, zmq.POLLIN):
            try:
                peer, frame = self._socket.recv_multipart(zmq.NOBLOCK)[:2]
                hello = decode(frame)
            except (ValueError, ProtocolError):
                continue  # garbage is dropped, as a session would
            if hello["kind"] == "hello":
                self._waiting.add(peer, hello)
        self._waiting.turn_away(self._socket, reason)

    # -- one session ------------------------------------------------------------------------------

    def _session(
        self,
        pull: Callable[[], Any],
        listed: list[CheckedItem] | None,
        all_cuda: bool,
        held: bool,
        fresh: bool,
        cancel: StopRequest,
        on_hello: Callable[[], Any] | None = None,
    ) -> TransferStats:
        """One session; ``listed``: the checked items, when the caller gave a list or tuple (its size is known up
        front); ``held``: the items' tensors stay as they are during the session, so small copies may be deferred;
        ``fresh``: each tensor is made for the sender (direct mode may keep it until the receiver read it)."""
        if self._socket is None or self._watch is None:
            raise TransferError(f"sender on {self.endpoint!r} is closed")
        run = _SendSession(
            self._watch,
            self._waiting,
            endpoint=self.endpoint,
            transport=self.transport,
            timeout_s=self.timeout_s,
            pull=pull,
            listed=listed,
            all_cuda=all_cuda,
            held=held,
            fresh=fresh,
            cancel=cancel,
            half_bytes=half_bytes_for(listed, self.half_bytes),
            direct=self.direct,
            on_hello=on_hello,
        )
        self.last_timings_s = run.timings
        self.last_split = None
        self.state = self.state.to(ChannelState.EXCHANGING)
        try:
            stats = run.run()
        except BaseException as exc:  # also KeyboardInterrupt / SystemExit from the caller's iterator
            try:
                run.abort(exc)
            finally:
                self._free_after(run, exc)
            raise
        finally:
            run.watch.unfollow()  # the socket stays: what its receiver sends from now on is stale
            if self.state is ChannelState.EXCHANGING:
                self.state = self.state.to(ChannelState.OPEN)
        run.free()
        self.last_split = run.split()
        return stats

    def _free_after(self, run: _SendSession, exc: BaseException) -> None:
        """After a failed session: free the bucket, without hiding ``exc``. The socket stays bound: receivers whose
        hellos are queued are served by the next sessions, and the failed one's frames are dropped as stale."""
        try:
            run.free()
        except Exception as late:
            log.error("sender on %r could not free the bucket after %r: %s", self.endpoint, exc, late)


class BucketedWeightSender(SenderChannel):
    """The sender's documented name and signature, kept: a ``SenderChannel`` (binds ``endpoint`` and sends weights
    to one receiver per ``send()``)."""


# -- One ``send()`` session of a ``BucketedWeightSender``: handshake, streaming, draining, release ---


END = object()  # what ``pull()`` returns when the caller's iterable is exhausted
CANCEL_SLICE_S = (
    0.05  # how often a wait with nothing to spin on (the lock, a hello, an async item) looks for cancellation
)


class _Cancelled(TransferError):
    """The session was stopped from another thread: its ``asend()`` was cancelled, or ``close()`` was called."""


class StopRequest(threading.Event):
    """Set from another thread to stop a running session at its next look (each item, each wait slice)."""

    def __init__(self) -> None:
        super().__init__()
        self.reason = "asend() was cancelled"

    def stop(self, reason: str) -> None:
        self.reason = reason
        self.set()


def _bucket_range(seq: int) -> record_function | None:
    """An open ``torch.profiler`` range (NVTX under ``emit_nvtx``) for bucket ``seq``, which the caller closes; None
    while no profiler runs (opening and closing one costs 10-20 us, a 0.6B sync ships five direct buckets)."""
    if not _profiler_enabled():
        return None
    span = record_function("refitkit.sync.bucket", args=f"seq={seq}")
    span.__enter__()
    return span


def _outcome_of_cancelled(endpoint: str, work: asyncio.Future) -> None:
    """Take the outcome of a cancelled ``asend()``'s session: its stop, or a failure or success that came first."""
    if work.cancelled():
        return
    failure = work.exception()
    if failure is not None and not isinstance(failure, _Cancelled):
        log.debug("sender on %r: asend() was cancelled; its session had ended with %r", endpoint, failure)


def _raise_if_cancelled(cancel: StopRequest | None, where: str) -> None:
    if cancel is not None and cancel.is_set():
        raise _Cancelled(f"{cancel.reason} {where}")


class _SendSession:
    """State of one send(): the peer, the bucket, the packer, the progress counters and sequence numbers."""

    def __init__(
        self,
        watch: PeerWatch,
        waiting: WaitingReceivers,
        *,
        endpoint: str,
        transport: str,
        timeout_s: float,
        pull: Callable[[], Any],
        listed: list[CheckedItem] | None,
        all_cuda: bool,
        held: bool,
        cancel: StopRequest | None,
        half_bytes: int,
        direct: bool = False,
        fresh: bool = False,
        on_hello: Callable[[], Any] | None = None,
    ) -> None:
        self.watch = watch  # the socket's connections: it follows this session's receiver's
        self.sock = watch.sock
        self.on_hello = on_hello  # the caller's, called once the first hello came
        self.waiting = waiting  # hellos queued for later sessions (the sender's, shared across its sessions)
        self.endpoint, self.transport, self.timeout_s = endpoint, transport, timeout_s
        self.timings: dict[str, float] = {}  # seconds per phase (the sender's last_timings_s)
        self.batch = held  # small copies deferred to one per run (packing.py): only for tensors that stay as they are
        self.fresh = fresh and not held  # each tensor made for us: direct buckets keep theirs only until consumed
        self.first_device = listed[0][1].device if listed else None
        self.checked = listed is not None  # a list's items were checked whole before the session
        self.all_cuda = all_cuda
        self.cancel = cancel
        self.half_bytes = half_bytes
        self.pull = pull
        self.session = secrets.token_hex(8)
        self.state = SendState.AWAITING_HELLO
        self.peer: bytes | None = None
        self.peer_pid: int | None = None  # as its hello says (for messages)
        self.peer_exchange: Any = None  # its hello's token, echoed by the setup or abort that answers it
        self.bucket: shm.ShmBucket | cuda_ipc.CudaIpcBucket | None = None
        self.packer: BucketPacker | None = None
        self.seq = 0
        self.span: record_function | None = None  # the profiler range of the bucket being packed
        self.unacked: deque[tuple[int, int]] = deque()  # (seq, bit mask of the halves it occupies)
        self.unpacked: deque[tuple[int, Any]] = deque()  # (seq, CUDA event or None) not announced packed yet
        self.own_work = handoff.OwnWork()  # the wait for the oldest of them
        self.consumed = 0  # buckets the receiver is done with
        self.ack_wait_s = 0.0
        self.items = 0
        self.seen: set[str] = set()
        self.need_cuda = transport == "cuda_ipc"
        # direct mode: the sender's allocations exported to the receiver, this bucket's entries, the tensors they are
        # (referenced until the session ends, or for fresh tensors until the receiver consumed their bucket: the
        # receiver reads them in place), and why others took the bucket
        self.direct = direct
        self.exports: cuda_ipc.AllocationExports | None = None
        self.direct_refusal: str | None = None  # why no tensor of this session can go direct
        self.direct_entries: list[Any] = []
        self.direct_allocs: list[int] = []
        self.direct_pending_bytes = 0  # of the entries not shipped yet
        self.direct_held: list[torch.Tensor] = []
        self.direct_shipped: deque[tuple[int, list[torch.Tensor]]] = deque()  # fresh: (seq, tensors) not consumed yet
        # fresh tensors live until their bucket is consumed: smaller direct buckets keep about bucket_bytes alive at most
        self.direct_ship_bytes = (
            min(DIRECT_SHIP_BYTES, max(half_bytes // 2, ALIGN_BYTES)) if self.fresh else DIRECT_SHIP_BYTES
        )
        self.direct_ship_tensors = DIRECT_MAX_TENSORS  # (set when the session's direct taker is made)
        self.direct_tensors = 0
        self.direct_bytes = 0
        self.bucket_reasons: dict[str, int] = {}
        self.bucket_tensors = 0
        self.bucket_bytes = 0
        self.bucket_state = (
            BucketState.LATER if direct and (held or fresh) and transport != "shm" else BucketState.WITH_SETUP
        )
        self.session_transport = "none"
        self.session_device: torch.device | None = None

    def run(self) -> TransferStats:
        start = time.perf_counter()
        self._allocate_early()
        hello = self._await_hello()
        self._mark("hello_wait", start)
        first = self._next_item()
        began = time.perf_counter()
        while True:
            try:
                self._set_up(hello, first)
                break
            except PeerGone:  # a queued hello whose receiver gave up since: free, and take the next one
                if self.state.setup_sent:
                    raise
                self.free()
                hello = self._await_hello()
        self._mark("setup", began)
        if self.on_hello is not None:  # (after the setup: the receiver maps what came with it meanwhile)
            self.on_hello()
        began = time.perf_counter()
        total_bytes = 0
        if first is not None:
            take_direct = self._direct_taker()
            self.span = _bucket_range(self.seq)  # a profiler range per bucket, packing to shipping
            try:
                total_bytes = self._stream(first, take_direct)
            finally:
                if self.span is not None:  # the stream stopped before its last bucket shipped
                    self.span.__exit__(None, None, None)
                    self.span = None
        else:
            self._send_bucket(0, False, [], True)  # an empty stream: the receiver still learns it ended
        self._mark("stream", began)
        began = time.perf_counter()
        self.state = self.state.to(SendState.DRAINING)
        self._wait(self._released, f"released for bucket {self.seq - 1}")
        self._mark("drain_and_release", began)
        log.debug("final ACK received", extra={"refit_event": "final_ack_received", "peer_pid": hello.get("pid")})
        return TransferStats(
            bytes=total_bytes,
            tensors=self.items,
            buckets=self.seq,
            seconds=time.perf_counter() - start,
            ack_wait_s=self.ack_wait_s,
        )

    def _stream(self, item: CheckedItem | None, take_direct: Callable[[str, torch.Tensor, str], bool] | None) -> int:
        """Check, place and ship every item from ``item`` on, then the last bucket; the bytes streamed."""
        next_item, unpacked = self._next_item, self.unpacked
        total_bytes = 0
        while item is not None:
            if take_direct is None or not take_direct(*item):
                (self.packer or self._late_packer()).pack(*item)
            total_bytes += item[1].nbytes
            if unpacked:  # announce finished buckets now, not when the next one is full
                self._announce_packed()
            item = next_item()
        if self.packer is None:  # every tensor went direct: their last bucket ends the stream
            self._ship_direct(last=True)
        else:
            if self.direct_entries:
                self._ship_direct()
            self.packer.finish()
        return total_bytes

    # -- direct mode: weights read where the trainer holds them ------------------------------------

    def _direct_taker(self) -> Callable[[str, torch.Tensor, str], bool] | None:
        """``take(name, tensor, wire_dtype)`` -> whether the tensor went into a direct bucket (else: the bucket path,
        its reason counted); None when this session packs everything (no direct mode asked for)."""
        if not self.direct:
            return None
        if self.session_transport != "cuda_ipc" or self.session_device is None:
            self.direct_refusal = "the session's transport is not cuda_ipc"
        elif not (self.batch or self.fresh):
            self.direct_refusal = (
                "the source's tensors may change or die while it is sent (a generator other than a module's or dict's, "
                "or an adapter's HeldWeights / FreshWeights)"
            )
        else:
            self.exports = cuda_ipc.AllocationExports(
                self.session_device, max_allocations=DIRECT_MAX_ALLOCATIONS, recycled=self.fresh
            )
        self.direct_ship_tensors = min(DIRECT_SHIP_TENSORS, DIRECT_MAX_TENSORS)
        return self._take_direct

    def _take_direct(self, name: str, tensor: torch.Tensor, wire_dtype: str) -> bool:
        # (once per tensor on the sender's critical path: each attribute read costs 0.1-0.5 us)
        exports = self.exports
        nbytes = tensor.nbytes
        if self.direct_refusal is not None:
            self._through_bucket(self.direct_refusal, nbytes)
            return False
        if exports is None or tensor.get_device() != exports.index:
            self._through_bucket("it is on another device than the session's", nbytes)
            return False
        if nbytes == 0 or not tensor.is_contiguous() or tensor.is_conj() or tensor.is_neg():
            self._through_bucket("it is empty, strided or a lazy conj/neg view", nbytes)
            return False
        pointer = tensor.data_ptr()
        if pointer % ALIGN_BYTES:
            self._through_bucket(f"its bytes are not {ALIGN_BYTES}-byte aligned (a view into a larger tensor)", nbytes)
            return False
        located = exports.locate(pointer, nbytes)
        if isinstance(located, str):
            self._through_bucket(located, nbytes)
            return False
        index, offset = located
        if len(self.direct_entries) >= self.direct_ship_tensors or self.direct_pending_bytes >= self.direct_ship_bytes:
            self._ship_direct()  # a full one ships when the next comes: the stream's last is never an empty bucket
        self.direct_allocs.append(index)
        self.direct_entries.append(entry_to_wire(name, wire_dtype, tensor.shape, offset))
        self.direct_held.append(tensor)
        self.direct_tensors += 1
        self.direct_bytes += nbytes
        self.direct_pending_bytes += nbytes
        return True

    def _late_packer(self) -> BucketPacker:
        """The packer of a session whose bucket waited until a tensor needed it: allocate the bucket now (its
        handle goes out with the first bucket frame that uses it)."""
        if not self.bucket_state.later or self.session_device is None or self.bucket is not None:
            raise TransferError("sender: a tensor to pack in a session without a bucket (a bug in refitkit)")
        began = time.perf_counter()
        self.bucket = self._new_bucket(self.session_device)
        self._mark("late_bucket", began)
        self.bucket_state = self.bucket_state.to(BucketState.LATE_PENDING)
        self.packer = BucketPacker(
            self.bucket.tensor,
            self.half_bytes,
            send_bucket=self._send_bucket,
            wait_free=self._wait_free,
            batch=self.batch,
        )
        return self.packer

    def _through_bucket(self, reason: str, nbytes: int) -> None:
        self.bucket_reasons[reason] = self.bucket_reasons.get(reason, 0) + 1
        self.bucket_tensors += 1
        self.bucket_bytes += nbytes

    def _ship_direct(self, *, last: bool = False) -> None:
        """Ship the pending direct entries as one bucket (``last``: the stream's last). It occupies neither half of
        the bucket (packing goes on beside it), but at most ``DIRECT_IN_FLIGHT`` direct buckets await the receiver
        at once."""
        if self.exports is None or not self.direct_entries:
            raise TransferError("sender: a direct bucket without exports or entries (a bug in refitkit)")
        entries, allocs = self.direct_entries, self.direct_allocs
        self.direct_entries, self.direct_allocs, self.direct_pending_bytes = [], [], 0
        self._send_direct(entries, allocs, last=last)
        if self.fresh:  # kept until the receiver consumed this bucket (_retire_consumed), not to the session's end
            self.direct_shipped.append((self.seq - 1, self.direct_held))
            self.direct_held = []

    def _send_direct(self, entries: list[Any], allocs: list[int], *, last: bool) -> None:
        """Send one direct bucket with the exports not announced yet, once fewer than ``DIRECT_IN_FLIGHT`` direct
        buckets await the receiver."""

        def room() -> bool:
            self._retire_consumed()
            return sum(1 for _, halves in self.unacked if not halves) < DIRECT_IN_FLIGHT

        if not room():
            self._wait(room, f"done for direct bucket {self.unacked[0][0]}")
        direct: dict[str, Any] = {"exports": self.exports.take_new(), "allocs": allocs}  # type: ignore[union-attr]
        if not self.fresh:  # held until the session ends: the receiver may say it is done once its reads are issued
            direct["kept"] = True
        self._send_bucket(0, True, entries, last, direct=direct)

    def split(self) -> DirectSplit | None:
        """How this session split between direct and bucket reads (None without direct mode)."""
        if not self.direct:
            return None
        return DirectSplit(
            direct_tensors=self.direct_tensors,
            direct_bytes=self.direct_bytes,
            bucket_tensors=self.bucket_tensors,
            bucket_bytes=self.bucket_bytes,
            allocations=len(self.exports.handles) if self.exports else 0,
            bucket_reasons=dict(self.bucket_reasons),
            replaced_allocations=self.exports.replaced if self.exports else 0,
        )

    def _mark(self, phase: str, began: float) -> None:
        self.timings[phase] = time.perf_counter() - began

    # -- items and buckets ------------------------------------------------------------------------

    def _next_item(self) -> CheckedItem | None:
        if self.cancel is not None and self.cancel.is_set():  # (no message built per item: the critical path)
            raise _Cancelled(f"{self.cancel.reason} after {self.items} items")
        item = self.pull()
        if item is END:
            return None
        if not self.checked:
            item = check_item(self.items, item, self.seen, need_cuda=self.need_cuda, detach=False)  # pack() detaches
        self.items += 1
        return item

    def _allocate_early(self) -> None:
        """Allocate and export the CUDA bucket while the receiver starts up (an engine's rpc takes milliseconds to
        reach its worker), when the session's transport and device are known before its hello and first item:
        ``transport='cuda_ipc'`` (a list's device, else the current one) or a list of CUDA tensors under ``auto``.
        The set-up keeps it when the hello and the first item agree, else frees it; a failure here (out of
        memory, say) is left to the set-up, which meets it again and then tells the receiver."""
        if self.bucket_state is not BucketState.WITH_SETUP:
            return  # a direct session: most likely no tensor needs the bucket
        if self.transport == "cuda_ipc":
            device = self.first_device or torch.device("cuda", torch.cuda.current_device())
        elif self.transport == "auto" and self.all_cuda and self.first_device is not None and cuda_ipc.ipc_available():
            device = self.first_device
        else:
            return
        began = time.perf_counter()
        try:
            self.bucket = cuda_ipc.CudaIpcBucket(2 * self.half_bytes, device=device)
        except (TransferError, RuntimeError) as exc:
            log.debug("sender on %r: no bucket before the hello (%s); the set-up allocates it", self.endpoint, exc)
            return
        self._mark("early_bucket", began)

    def _set_up(self, hello: dict[str, Any], first: CheckedItem | None) -> None:
        transport = self._choose_transport(hello, first)
        half = self.half_bytes
        early = self.bucket  # from _allocate_early: kept if the session turned out to need just that
        if early is not None and not (
            transport == "cuda_ipc" and first is not None and early.device == first[1].device
        ):
            self.free()
        self.session_transport = transport
        self.session_device = first[1].device if first is not None else None
        if self.bucket_state.later and transport != "cuda_ipc":
            self.bucket_state = self.bucket_state.to(BucketState.WITH_SETUP)
        if transport == "shm":
            self.bucket = self._new_bucket(None, peer_pidns=hello.get("pidns"))
        elif transport == "cuda_ipc" and first is not None and self.bucket is None and not self.bucket_state.later:
            self.bucket = self._new_bucket(first[1].device)
        handle = self.bucket.handle() if self.bucket is not None else {}
        extra: dict[str, Any] = {"bucket_later": True} if self.bucket_state.later else {}
        self._send(
            encode(
                "setup",
                exchange=self.peer_exchange,
                session=self.session,
                pid=os.getpid(),  # followed by the receiver (a pidfd), where it shares our PID namespace
                pidns=shm.pid_namespace(),
                transport=transport,
                half_bytes=half,
                handle=handle,
                **extra,
            )
        )
        self.state = self.state.to(SendState.OFFERED)
        # No wait for "ready": buckets are packed and their frames queued while the receiver maps the buffer.
        if self.bucket is not None:
            self.packer = BucketPacker(
                self.bucket.tensor, half, send_bucket=self._send_bucket, wait_free=self._wait_free, batch=self.batch
            )

    def _new_bucket(
        self, device: torch.device | None, *, peer_pidns: Any = None
    ) -> shm.ShmBucket | cuda_ipc.CudaIpcBucket:
        """The session's bucket, two halves of ``half_bytes``: shared memory (``device`` None) or CUDA IPC memory on
        ``device``; one that cannot be had is a TransferError naming its size and the knob, the cause chained."""
        nbytes = 2 * self.half_bytes
        try:
            if device is None:
                return shm.ShmBucket(nbytes, session=self.session, peer_pidns=peer_pidns)
            return cuda_ipc.CudaIpcBucket(nbytes, device=device)
        except (OSError, RuntimeError) as exc:  # (a TransferError is a RuntimeError: its message says more)
            where = "shared memory" if device is None else f"CUDA IPC memory on {device}"
            knob = "" if "bucket_bytes" in str(exc) else "; pass a smaller bucket_bytes"
            raise TransferError(
                f"{self.state.phase.value}: cannot allocate the session's bucket of {nbytes} bytes ({where}, two halves "
                f"of {self.half_bytes} from bucket_bytes) for the receiver on {self.endpoint!r}: {exc}{knob}"
            ) from exc

    def _choose_transport(self, hello: dict[str, Any], first: CheckedItem | None) -> str:
        if first is None:
            return "none"
        receiver_cuda = hello.get("device") == "cuda"
        wanted = self.transport
        if wanted == "cuda_ipc" and not receiver_cuda:
            raise TransferError(f"transport='cuda_ipc' but the receiver on {self.endpoint!r} is on the CPU")
        if wanted == "auto":  # (a list: cuda_ipc only when every tensor is on CUDA; it was checked for no device)
            on_cuda = self.all_cuda if self.checked else first[1].is_cuda
            wanted = "cuda_ipc" if receiver_cuda and on_cuda and cuda_ipc.ipc_available() else "shm"
        self.need_cuda = wanted == "cuda_ipc"
        if self.need_cuda and not first[1].is_cuda:
            raise InvalidInput(f"{first[0]!r} is on {first[1].device}; transport='cuda_ipc' needs CUDA tensors")
        return wanted

    def _send_bucket(
        self, half: int, wide: bool, entries: list[Any], last: bool, *, direct: dict[str, Any] | None = None
    ) -> None:
        """Ship one bucket whose copies were just issued: its frame now, its "packed" once the copies finished (for a
        direct bucket: once the work queued so far on the current stream, which wrote its tensors, finished)."""
        if entries and (self.bucket is not None or direct is not None):  # an empty bucket has no bytes to announce
            if self.bucket is not None:
                stream = self.bucket.shipped()
            else:  # a direct bucket in a session without a bucket (yet): its tensors were written on this stream
                stream = torch.cuda.current_stream(self.session_device)
            self.unpacked.append((self.seq, handoff.event_after(stream)))
        extra: dict[str, Any] = {} if direct is None else {"direct": direct}
        if direct is None and self.bucket_state is BucketState.LATE_PENDING:  # the first packed into a late bucket
            extra["handle"] = self.bucket.handle()  # type: ignore[union-attr]
            self.bucket_state = self.bucket_state.to(BucketState.ANNOUNCED)
        self._send(
            encode(
                "bucket", session=self.session, seq=self.seq, half=half, wide=wide, last=last, entries=entries, **extra
            )
        )
        self.unacked.append((self.seq, 0 if direct is not None else BOTH_HALVES if wide else 1 << half))
        self.seq += 1
        if self.span is not None:  # the shipped bucket's range ends
            self.span.__exit__(None, None, None)
            self.span = None
        if not last:  # the next one's begins (while a profiler runs)
            self.span = _bucket_range(self.seq)
        self._announce_packed()

    def _announce_packed(self) -> None:
        """A ``packed`` frame for every bucket whose copies have finished, in order."""
        if self.unpacked:
            handoff.announce_finished(
                self.unpacked, lambda seq: self._send(encode("packed", session=self.session, seq=seq))
            )

    def _released(self) -> bool:
        """The final ACK: the ``released`` frame, which the receiver sends only after it released its mapping."""
        return self.state is SendState.RELEASED

    def _wait_free(self, halves: int) -> None:
        """Wait until no bucket in flight occupies ``halves`` (double buffering: we overwrite them next)."""

        def free() -> bool:
            self._retire_consumed()
            return not any(mask & halves for _, mask in self.unacked)

        if not free():
            self._wait(free, f"done for bucket {self.unacked[0][0]}")

    def _retire_consumed(self) -> None:
        """Forget the buckets in flight that the receiver announced as done."""
        while self.unacked and self.unacked[0][0] < self.consumed:
            self.unacked.popleft()
        while self.direct_shipped and self.direct_shipped[0][0] < self.consumed:
            self.direct_shipped.popleft()  # the receiver's reads of these ran: the trainer may free or reuse them

    def _wait(self, condition: Callable[[], bool], waiting_for: str) -> None:
        """Until ``condition()``: block in the kernel on the socket (frames are read as they come), bounded by
        ``timeout_s``; an error frame from the receiver raises TransferError once read, the receiver's death (its
        connection's end) PeerGone.
        """

        def ready() -> bool:
            self._announce_packed()
            return condition()

        def look(left_s: float) -> None:
            slice_s = left_s
            if self.cancel is not None:
                if self.cancel.is_set():
                    raise _Cancelled(f"{self.cancel.reason} while waiting for {waiting_for}")
                slice_s = min(left_s, CANCEL_SLICE_S)
            if self.watch.lost:  # seen by an earlier look, and ready() found nothing since
                raise self._gone(waiting_for)
            if self.unpacked and not self.watch.poll(0):  # nothing from the receiver yet: our copies end first
                self.own_work.wait(
                    self.unpacked, left_s=left_s, slice_s=slice_s, timeout_s=self.timeout_s, phase=self.state.phase
                )
                return
            self._read_frames(0 if self.unpacked else handoff.poll_ms(slice_s))

        began = time.perf_counter()
        try:
            handoff.wait_until(
                ready,
                look,
                timeout_s=self.timeout_s,
                phase=self.state.phase,
                waiting_for=waiting_for,
                peer=f"the receiver on {self.endpoint!r}",
            )
        finally:
            self.ack_wait_s += time.perf_counter() - began

    # -- frames ---------------------------------------------------------------------------------

    def _send(self, payload: bytes) -> None:
        if self.peer is None:
            raise TransferError(f"{self.state.value}: no receiver to send to on {self.endpoint!r} (a bug in refitkit)")
        try:
            self.sock.send_multipart([self.peer, payload], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._read_frames(0)  # a receiver that failed and left reported why first: raise that
            raise PeerGone(
                f"{self.state.phase.value}: {self._peer_name()} is gone (a frame to it was refused: {exc}) at bucket "
                f"{self.seq}"
            ) from exc

    def _gone(self, waiting_for: str) -> PeerGone:
        """The error of a wait that the receiver's death (its connection's end) cut short."""
        return PeerGone(f"{self.watch.gone(self.state.phase, waiting_for)} ({self.seq} buckets sent)")

    def _recv(self, waiting_for: str, timeout_s: float | None = None) -> tuple[bytes, dict[str, Any]] | None:
        """The next frame and who sent it; None for one that is not the session's receiver's and is no frame of
        ours at all (garbage from another process of our uid): dropped, and logged."""
        parts = recv_frame(
            self.watch,
            timeout_s=self.timeout_s if timeout_s is None else timeout_s,
            phase=self.state.phase,
            waiting_for=waiting_for,
            peer=self._peer_name(),
            copy=False,
        )
        peer = parts[0].bytes
        try:
            if len(parts) != 2:
                raise ProtocolError(f"{self.state.phase.value}: a {len(parts) - 1}-part message on {self.endpoint!r}")
            frame = decode(parts[1].bytes)
        except ProtocolError as exc:
            if peer == self.peer:
                raise  # the session's receiver broke the protocol
            log.warning("sender on %r dropped a frame that is not its receiver's: %s", self.endpoint, exc)
            return None
        if frame["kind"] == "hello":
            self.watch.note_hello(peer, parts[1])
        return peer, frame

    def _peer_name(self) -> str:
        return f"the receiver on {self.endpoint!r}" + (f" (pid {self.peer_pid})" if self.peer_pid is not None else "")

    def _take_hello(self, peer: bytes, frame: dict[str, Any]) -> bool:
        """Make ``peer`` this session's receiver, unless its hello is stale: its session was served already, or its
        connection closed since it said hello (it gave up or died)."""
        if self.waiting.served(peer, frame) or self.watch.left(peer):
            log.debug("sender on %r dropped a hello whose receiver is gone", self.endpoint)
            return False
        self.waiting.serve(peer, frame)
        self.peer = peer
        self.peer_exchange = frame.get("exchange")  # echoed by the setup or abort that answers it
        pid = frame.get("pid")
        self.peer_pid = pid if type(pid) is int else None
        self.watch.follow(peer, self._peer_name())
        self.watch.follow_process(self.peer_pid, frame.get("pidns"))
        return True

    def _await_hello(self) -> dict[str, Any]:
        waiting = self.waiting.take()
        while waiting is not None:
            if self._take_hello(*waiting):
                return waiting[1]
            waiting = self.waiting.take()
        waiting_for = "hello (is a receiver connected?)"
        deadline = time.monotonic() + self.timeout_s
        while True:  # in slices when stoppable, so that a cancelled asend() or close() stops the wait
            _raise_if_cancelled(self.cancel, "while waiting for a receiver's hello")
            left_s = max(0.0, deadline - time.monotonic())
            slice_s = min(left_s, CANCEL_SLICE_S) if self.cancel is not None else left_s
            if not self.watch.poll(int(slice_s * 1000)):
                if time.monotonic() >= deadline:
                    raise timeout_error(self.state.phase, waiting_for, self._peer_name(), self.timeout_s)
                continue
            got = self._recv(waiting_for, timeout_s=0.0)
            if got is None:
                continue
            peer, frame = got
            if frame["kind"] == "hello" and self._take_hello(peer, frame):
                return frame
            if frame["kind"] != "hello":
                log.debug("sender on %r dropped a stale %s frame before the handshake", self.endpoint, frame["kind"])

    def _read_frames(self, timeout_ms: int) -> None:
        """Handle the frames already queued (waiting up to ``timeout_ms`` for the first) up to the final ACK: what
        follows it (the next session's hello) is left for the next session. At most ``FRAMES_PER_LOOK`` of them: a
        peer flooding the socket cannot hold a wait past its bound."""
        for _ in range(FRAMES_PER_LOOK):
            if self.state is SendState.RELEASED or not self.watch.poll(timeout_ms):
                return
            timeout_ms = 0
            got = self._recv("a frame", timeout_s=0.0)
            if got is not None:
                self._handle(*got)

    def _handle(self, peer: bytes, frame: dict[str, Any]) -> None:
        if frame["kind"] == "hello":
            if peer == self.peer and self.waiting.served(peer, frame):  # a real receiver says each hello once
                raise ProtocolError(f"expected a ready/done/released frame, got 'hello' again from {self._peer_name()}")
            self.waiting.add(peer, frame)  # the next sync's receiver (it waits, bounded by its own timeout_s)
            if peer == self.peer:  # this session's receiver says hello again only once it has left this session
                raise PeerGone(
                    f"{self.state.phase.value}: {self._peer_name()} started its next sync before this one ended (it "
                    f"gave up on this one; {self.seq} buckets sent); its new hello is served by the next send()"
                )
            return
        if peer != self.peer or frame.get("session") != self.session:
            # a well-formed frame of an earlier session (its receiver's late words), or from another process of ours
            log.debug("sender on %r dropped a %s frame that is not this session's", self.endpoint, frame["kind"])
            return
        if frame["kind"] == "error":
            message = str(frame.get("message"))
            self.state = self.state.to(SendState.PEER_FAILED)  # the receiver released before it reported
            remote, phase = remote_failure(frame), frame.get("phase")
            error = TransferError(
                f"receiver on {self.endpoint!r} failed ({phase if type(phase) is str else brief(phase)}; {self.seq} "
                f"buckets sent): {message}",
                remote_message=message,
                remote_type=remote.remote_type if remote else None,
                remote_traceback=remote.remote_traceback if remote else None,
            )
            if remote is None:
                raise error
            raise error from remote
        expect(frame, "ready", "done", "released", session=self.session)
        kind, seq = frame["kind"], frame.get("seq")
        if kind == "ready" and self.state.setup_sent:
            if self.state is SendState.OFFERED:
                self.state = self.state.to(SendState.STREAMING)
            if self.bucket is not None:
                self.bucket.receiver_mapped()
            return
        if kind == "done" and type(seq) is int and seq == self.consumed and seq < self.seq:
            self.consumed = seq + 1
            return
        if kind == "released" and seq == self.seq - 1 and not self.unpacked and self.state is SendState.DRAINING:
            self.state = self.state.to(SendState.RELEASED)
            return
        raise ProtocolError(f"unexpected {kind} for bucket {seq!r} (sent {self.seq} buckets)")

    # -- failure and cleanup ----------------------------------------------------------------------

    def abort(self, exc: BaseException) -> None:
        """Tell a live receiver the session is over and, when it can still answer, wait for it to release."""
        if self.state in (SendState.RELEASED, SendState.PEER_FAILED, SendState.ABORTED):
            return  # it already released (and reported), or was told
        setup_sent = self.state.setup_sent
        self.state = self.state.to(SendState.ABORTED)
        if self.peer is None:
            return  # no receiver yet
        try:
            reason = str(exc) if isinstance(exc, _Cancelled) else repr(exc)  # (the stop's own words, not its class)
            frame = encode("abort", session=self.session, reason=reason, exchange=self.peer_exchange)
            self.sock.send_multipart([self.peer, frame], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return
        if isinstance(exc, (TransferTimeout, ProtocolError)) or not setup_sent:
            return  # the peer is dead, hostile or was never asked to map the bucket: free without waiting
        # Wait (bounded) for the receiver to unmap (it may still be mapping: setup went out before
        # ready came back) before the bucket is freed under it.
        deadline = time.monotonic() + self.timeout_s
        try:
            while time.monotonic() < deadline:
                got = self._recv("released after abort", timeout_s=max(0.0, deadline - time.monotonic()))
                if got is None:
                    continue
                peer, frame = got
                if (
                    peer == self.peer
                    and frame["kind"] in ("released", "error")
                    and frame.get("session") == self.session
                ):
                    return
                if peer != self.peer and frame["kind"] == "hello":
                    self.waiting.add(peer, frame)
        except TransferError as late:
            log.warning("receiver did not confirm the abort on %r: %s", self.endpoint, late)

    def free(self) -> None:
        """Free the bucket (idempotent); after this the sender holds no bucket memory."""
        if self.packer is not None:
            self.packer.detach()  # a traceback may still reference the packer; it must not keep the bucket
        self.packer = None
        bucket, self.bucket = self.bucket, None
        try:
            if bucket is not None:
                began = time.perf_counter()
                bucket.free()  # after every stream a bucket was shipped on ran
                self._mark("free", began)
        finally:
            self.direct_held = []  # the trainer's own tensors: referenced no longer (the receiver released or is gone)
            self.direct_shipped.clear()
