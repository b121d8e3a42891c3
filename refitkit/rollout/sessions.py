"""One refitkit session received in place into a live engine's model: what every engine's side of a push shares.

An engine rank (a vLLM worker, an SGLang scheduler) keeps a receiver for its sender's endpoint, lands each bucket's
views straight into its parameters through ``DirectLoads`` (one copy on arrival), then records what
the sync covered in its ``EngineWeights``. What differs per engine (its model, its loader, its
post-processing, whether its weights are released) is handed in by the caller. The driving side shares the checks of a push's arguments
and the bounded wait for an engine's call.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from refitkit.errors import (
    EngineError,
    EngineTimeout,
    InvalidInput,
    LinkClosed,
    RefitError,
    TransferError,
    UnknownWeight,
    WeightRejected,
    WeightShapeMismatch,
)
from refitkit.rollout.load_plan import DirectLoads, LandedStats
from refitkit.rollout.versions import MISSING_SHOWN, EngineWeights, SyncCoverage, coverage_of
from refitkit.transfer import BroadcastWeightReceiver, ChannelState, TransferStats
from refitkit.transfer.packing import check_items

log = logging.getLogger(__name__)


@dataclass
class SyncProgress:
    """What a sync has handed to the engine's loader so far: the names, and whether any tensor at all."""

    names: set[str] = field(default_factory=set)
    touched: bool = False
    landed: LandedStats = field(default_factory=LandedStats)  # direct copies vs the model's loader (in place)
    loader_s: float = 0.0  # landing the buckets (issuing the copies; they run on the device behind)
    post_s: float = 0.0  # the engine's post-processing, once per in-place sync
    handing: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)  # refused, or in the loader's hands
    refusal: Exception | None = None  # a weight refused, or the loader's error (kept: the receiver sends only text)


@dataclass(frozen=True)
class WeightCheck:
    """What an engine rank loaded from its checkpoint, to check pushed weights against and to name the weight a
    loader refused: ``shapes`` by Hugging Face name (None: unknown), ``engine`` the rank in messages."""

    shapes: Mapping[str, tuple[int, ...]] | None
    engine: str

    def refusal(
        self, weights: Sequence[tuple[str, torch.Tensor]], progress: SyncProgress
    ) -> WeightShapeMismatch | None:
        """The refusal of the first of ``weights`` whose shape is not the checkpoint's, recorded in ``progress``, for
        the caller to raise before the loader sees any of them: vLLM's loaders fail on some with an empty message, and
        cut others to fit (a q_proj with a row too many loads silently)."""
        if self.shapes is None:
            return None
        expected_of = self.shapes.get
        for name, tensor in weights:  # (per weight of every sync: kept to a lookup and a compare)
            expected = expected_of(name)
            if expected is not None and tensor.shape != expected:
                shape = tuple(tensor.shape)
                break
        else:
            return None
        progress.handing = [(name, shape)]
        progress.refusal = WeightShapeMismatch(
            f"{self.engine} refused weight {name!r}: pushed with shape {list(shape)}, but the checkpoint it loaded has "
            f"{list(expected)} (phase: shape check, before loading it). {_AFTER_REFUSAL}",
            weight=name,
            shape=shape,
            expected_shape=expected,
            engine=self.engine,
            phase="shape check",
        )
        return progress.refusal

    def rejection(self, progress: SyncProgress, *, phase: str) -> WeightRejected | None:
        """The refusal recorded in ``progress`` as a ``WeightRejected`` naming the weight in the loader's hands and both
        shapes; None when no weight was refused (the stream itself failed: that error stands)."""
        error, handing = progress.refusal, progress.handing
        if error is None or isinstance(error, WeightRejected):
            return error
        if not handing:  # the loader had taken the whole stream (its post-processing failed): no weight to name
            return None
        unknown = [(name, shape) for name, shape in handing if self.shapes is not None and name not in self.shapes]
        said = f"{type(error).__name__}: {error}"
        fields = {
            "engine": self.engine,
            "phase": phase,
            "remote_type": type(error).__name__,
            "remote_message": str(error),
        }
        if unknown:
            name, shape = unknown[0]
            return UnknownWeight(
                f"{self.engine} has no parameter for pushed weight {name!r} (shape {list(shape)}; the checkpoint it "
                f"loaded has no such name): its loader raised {said} (phase: {phase}). {_AFTER_REFUSAL}",
                weight=name,
                shape=shape,
                expected_shape=None,
                **fields,
            )
        if len(handing) == 1:  # (layerwise: one weight at a time)
            name, shape = handing[0]
            expected = None if self.shapes is None else self.shapes.get(name)
            return WeightRejected(
                f"{self.engine}'s loader refused weight {name!r} (pushed shape {_listed(shape)}, the checkpoint's "
                f"{_listed(expected)}): {said} (phase: {phase}). {_AFTER_REFUSAL}",
                weight=name,
                shape=shape,
                expected_shape=expected,
                **fields,
            )
        names = [name for name, _ in handing]
        shown = f"{names[:MISSING_SHOWN]}{' ...' if len(names) > MISSING_SHOWN else ''}"
        return WeightRejected(
            f"{self.engine}'s loader refused one of the weights {shown} ({_bucket_shapes(self.shapes)}): {said} "
            f"(phase: {phase}). {_AFTER_REFUSAL}",
            weight=", ".join(names),
            shape=None,
            expected_shape=None,
            **fields,
        )


_AFTER_REFUSAL = (
    "The weights before it were loaded, so the engine reports its weights incomplete until a full push lands: push "
    "the checkpoint's names and shapes (Hugging Face layout)"
)


def _bucket_shapes(shapes: Mapping[str, tuple[int, ...]] | None) -> str:
    return "the checkpoint's shapes are unknown" if shapes is None else "their shapes are the checkpoint's"


def _listed(shape: tuple[int, ...] | None) -> str:
    return "unknown" if shape is None else str(list(shape))


def land_in_place(
    receive: Callable[[Callable[..., Any]], TransferStats],
    direct: DirectLoads,
    progress: SyncProgress,
    check: WeightCheck | None = None,
) -> TransferStats:
    """Run ``receive(on_bucket)`` with each bucket landed through ``direct`` (its views are valid during the call),
    every weight of a bucket checked by ``check`` before any of it lands."""
    direct.begin()

    def on_bucket(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
        began = time.perf_counter()
        refused = None if check is None else check.refusal(weights, progress)
        if refused is not None:
            raise refused
        progress.names.update(name for name, _ in weights)
        progress.touched = progress.touched or bool(weights)
        try:
            progress.landed += direct.land(weights)
        except Exception as exc:  # kept for the rank's verdict (the receiver drops its frames' locals: bucket views)
            progress.handing = [(name, tuple(tensor.shape)) for name, tensor in weights]
            progress.refusal = exc
            raise
        progress.loader_s += time.perf_counter() - began

    return receive(on_bucket)


def refuse_session(receiver: Any, error: EngineError) -> NoReturn:
    """Open ``receiver``'s session and fail it with ``error`` before any byte lands (the sender hears why at once: its
    ``TransferError``'s cause carries ``error`` as its code and fields), then raise ``error`` here."""

    def refuse(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
        raise error

    try:
        receiver.receive(refuse)
    except EngineError:
        pass
    except TransferError as exc:  # the session failed with our refusal (its cause): the sender heard it
        if exc.__cause__ is not error:
            raise
    raise error


def record_landing(
    weights: EngineWeights, version: int, names: set[str], expected: frozenset[str] | None
) -> SyncCoverage:
    """A sync's stream arrived whole: record its coverage against the names the engine loads (None: unknown)."""
    coverage = coverage_of(names, expected)
    weights.landed(version, coverage)
    if not coverage.complete:
        log.warning("weight sync of version %d covered only %s: weights incomplete", version, coverage.describe())
    return coverage


def sync_report(
    stats: TransferStats, version: int, coverage: SyncCoverage, progress: SyncProgress, began: float
) -> dict[str, Any]:
    """One sync as plain values: the transfer's stats, the version and its coverage, and the rank's seconds
    (``load_s`` the whole sync, ``loader_s`` in the loaders, ``post_s`` in post-processing) and landing counts."""
    landed = progress.landed
    return {
        "bytes": stats.bytes,
        "tensors": stats.tensors,
        "buckets": stats.buckets,
        "seconds": stats.seconds,
        "ack_wait_s": stats.ack_wait_s,
        "version": version,
        "complete": coverage.complete,
        "expected": coverage.expected,
        "missing": list(coverage.missing),
        "load_s": time.perf_counter() - began,
        "loader_s": progress.loader_s,
        "post_s": progress.post_s,
        "direct_tensors": landed.direct_tensors,
        "direct_bytes": landed.direct_bytes,
        "loader_tensors": landed.loader_tensors,
        "loader_bytes": landed.loader_bytes,
    }


def checked_timeout(sender: Any, timeout_s: float | None) -> float:
    """A push's bound: ``timeout_s``, or the sender's own; a positive number of seconds."""
    timeout_s = sender.timeout_s if timeout_s is None else float(timeout_s)
    if not timeout_s > 0:
        raise InvalidInput(f"timeout_s={timeout_s!r}; need a positive number of seconds")
    return timeout_s


def checked_first_rank(first_rank: Any) -> int:
    """A broadcast push's first engine rank: an int >= 1 (rank 0 is the sender)."""
    if isinstance(first_rank, bool) or not isinstance(first_rank, int) or first_rank < 1:
        raise InvalidInput(f"first_rank={first_rank!r}; need an int >= 1 (rank 0 is the sender)")
    return first_rank


def checked_weights(weights: Any, *, need_cuda: bool) -> Any:
    """A list or tuple checked whole (refused before the engine waits: it sees no byte of it), else an iterator."""
    try:
        weights = weights if isinstance(weights, (list, tuple)) else iter(weights)
    except TypeError:
        raise InvalidInput(f"weights is a {type(weights).__name__}, not an iterable of (name, tensor)") from None
    if isinstance(weights, (list, tuple)):
        check_items(weights, need_cuda=need_cuda)
    return weights


def bounded_result(
    future: concurrent.futures.Future, *, timeout_s: float, what: str, within: str, context: str = ""
) -> Any:
    """``future``'s result (an engine's call), waited for at most ``timeout_s``: ``EngineTimeout`` naming ``what`` and
    the bound (``within``) if it did not come; the engine's exception becomes an ``EngineError`` naming ``what``
    (refitkit's own errors pass as they are). ``context`` is added to either message."""
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise EngineTimeout(f"{what} did not return within {within}{context}") from None
    except RefitError:
        raise
    except Exception as exc:
        raise EngineError(f"{what} failed{context}: {type(exc).__name__}: {exc}") from exc


def bounded_call(
    call: Callable[[], Any],
    *,
    timeout_s: float,
    what: str,
    within: str,
    context: str = "",
    helpers: HelperThreads | None = None,
) -> Any:
    """``call()`` in a helper thread, its result as ``bounded_result`` gives it; a call still stuck when the bound
    passed ends on its own (nothing waits for it). ``helpers``: the caller's threads (a link's, kept across its calls);
    None: threads of this call's own, ended before it returns."""
    if helpers is None:
        with HelperThreads(what) as own:
            return bounded_call(call, timeout_s=timeout_s, what=what, within=within, context=context, helpers=own)
    with helpers.use() as submit:
        return bounded_result(submit(call), timeout_s=timeout_s, what=what, within=within, context=context)


HELPER_THREAD_PREFIX = "refitkit-engine-call"  # the name of every helper thread starts so
HELPER_THREADS = 2  # per owner: a push runs the engine's receive and its prefix-cache reset side by side
CLOSE_JOIN_S = 5.0  # how long close() waits for its idle threads to end (they end at once unless the machine stalls)


class HelperThreads:
    """The threads that run an engine's blocking calls (an rpc, a cache reset) while the caller sends or waits, each
    call bounded by its caller; owned by what makes the calls: a link for its life, a one-shot push for itself.

    Made lazily at the first call and kept between calls. A call still running when its caller gave up (stuck past
    its bound) retires the threads it ran on: the next call gets fresh ones, never queued behind it, and the stuck
    one is reported, never waited for. ``close()`` ends them (``with`` closes too). Used from another process than
    the one that made them (a forked child, which has none of these threads) or after ``close()``, they raise
    ``LinkClosed`` naming ``owner``."""

    def __init__(self, owner: str) -> None:
        self.owner = owner  # in messages: "VllmLink", "vLLM push_weights"
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._prefix = ""  # the current pool's thread names start with it
        self._pools_made = 0
        self._retired: list[str] = []  # the thread-name prefixes of pools left to a stuck call
        self._closed = False

    def check_usable(self) -> None:
        """``LinkClosed`` unless calls may run here: not closed, and in the process that made the threads."""
        if os.getpid() != self._pid:
            raise LinkClosed(
                f"{self.owner} was made in process {self._pid} and is used in process {os.getpid()} (a forked child): "
                f"its helper threads exist only in the process that made it; make a new {self.owner} in this process"
            )
        if self._closed:
            raise LinkClosed(
                f"{self.owner} is closed: its helper threads are gone; make a new {self.owner} to push again"
            )

    @contextmanager
    def use(self) -> Iterator[Callable[..., concurrent.futures.Future]]:
        """``submit(call, *args)`` for the calls of one push or one engine call; a call of theirs still running at the
        end (its caller gave up on it) retires these threads."""
        self.check_usable()  # (before the lock: in a forked child it may be held by a thread that is not there)
        with self._lock:
            self.check_usable()  # (closed meanwhile)
            if self._pool is None:
                self._prefix = f"{HELPER_THREAD_PREFIX}-{self._pid}-{id(self):x}-{self._pools_made}"
                self._pool = concurrent.futures.ThreadPoolExecutor(HELPER_THREADS, thread_name_prefix=self._prefix)
                self._pools_made += 1
            pool, prefix = self._pool, self._prefix
        futures: list[concurrent.futures.Future] = []

        def submit(call: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
            future = pool.submit(call, *args)
            futures.append(future)
            return future

        try:
            yield submit
        finally:
            if not all(future.done() for future in futures):
                self._retire(pool, prefix)

    def close(self) -> None:
        """End the threads: idle ones are joined (at most ``CLOSE_JOIN_S`` in all); one still in a call that its caller
        gave up on is logged and left to end on its own. Closing twice is fine; in a forked child it only drops the
        parent's threads (they are not in this process)."""
        if os.getpid() != self._pid:  # (the lock too may be a copy held by a thread that is not here)
            self._closed, self._pool = True, None
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool, prefix, self._pool = self._pool, self._prefix, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + CLOSE_JOIN_S
        left = []
        for thread in _threads_named(prefix) if pool is not None else []:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                left.append(thread.name)
        stuck = [thread.name for retired in self._retired for thread in _threads_named(retired)]
        if left or stuck:
            log.warning(
                "%s closed with helper threads still running engine calls its callers gave up on: %s; they end when "
                "those calls return (nothing waits for them)",
                self.owner,
                ", ".join(stuck + left),
            )

    def _retire(self, pool: concurrent.futures.ThreadPoolExecutor, prefix: str) -> None:
        with self._lock:
            if self._pool is pool:
                self._pool = None
            self._retired.append(prefix)
        pool.shutdown(wait=False, cancel_futures=True)  # its idle thread ends now, the stuck one when its call returns
        log.warning(
            "%s: an engine call still runs in a helper thread after its caller gave up on it; its threads are not used "
            "again (%s)",
            self.owner,
            ", ".join(thread.name for thread in _threads_named(prefix)),
        )

    def __enter__(self) -> HelperThreads:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _threads_named(prefix: str) -> list[threading.Thread]:
    """The live threads of one pool (``ThreadPoolExecutor`` names them ``<prefix>_<n>``)."""
    return [thread for thread in threading.enumerate() if thread.name.startswith(f"{prefix}_")]


def close_receiver(receiver: Any, where: str) -> None:
    """Close a kept receiver channel (``BucketedWeightReceiver``, ``BroadcastWeightReceiver`` where it has a
    ``close()``). A failure is logged, not raised: releasing an old connection must not fail the sync or the shutdown
    that replaces it."""
    close = getattr(receiver, "close", None)
    if receiver is None or not callable(close):
        return
    try:
        close()
    except Exception:
        log.warning(
            "%s: closing its kept receiver of %s failed", where, getattr(receiver, "endpoint", "?"), exc_info=True
        )


class KeptBroadcast:
    """One engine rank's ``BroadcastWeightReceiver``, kept from one sync to the next while it is opened with the same
    arguments (its process group is then reused), replaced (the old one closed) otherwise; ``where`` names the rank in
    log lines. Shared by the vLLM worker and the SGLang scheduler."""

    def __init__(self, device: Any, where: str) -> None:
        self.device, self.where = device, where
        self._receiver: BroadcastWeightReceiver | None = None
        self._key: tuple[Any, ...] | None = None  # what the kept receiver was opened with

    def open(
        self, rendezvous: str, secret: str | bytes, rank: int, backend: str, timeout_s: float
    ) -> BroadcastWeightReceiver:
        """The kept receiver if it is open and was opened with these arguments, else a new one."""
        key = (rendezvous, secret, rank, backend, timeout_s)
        receiver = self._receiver
        if receiver is None or receiver.state is not ChannelState.OPEN or self._key != key:
            self.close()
            receiver = BroadcastWeightReceiver(
                rendezvous, secret=secret, rank=rank, device=self.device, backend=backend, timeout_s=timeout_s
            )
            self._receiver, self._key = receiver, key
        return receiver

    def close(self) -> None:
        """Close the kept receiver, if any (a failure is logged: ``close_receiver``)."""
        receiver, self._receiver, self._key = self._receiver, None, None
        close_receiver(receiver, self.where)
