"""The refit cycle for one trainer rank: sync weights, offload, flush, barrier; later reload.

Failures cross ranks, bounded. Each phase's outcome is exchanged between the trainer ranks on a
dedicated gloo group (``refitkit.ranks.RankGroup``) before the next phase starts, so a phase that
fails on one rank never leaves another rank inside a collective:

- ``sync_weights``: the sending rank that loses its receiver keeps iterating ``named_weights()``
  (the gathers every rank takes part in) without sending, then all ranks exchange the outcome. On
  failure nothing was offloaded: the state stays ON_DEVICE on every rank.
- ``offload`` + ``flush_device``, then the barrier, which is the same exchange: a rank whose
  offload failed makes every rank raise instead of waiting out ``barrier_timeout_s``. Before they
  raise, every rank reloads what it offloaded (the rollback) and a second exchange tells each whether
  that worked everywhere: a failed ``refit()`` leaves every rank ON_DEVICE, as it found them, and the
  next ``refit()`` works as is; where the rollback failed, every rank's error says to call
  ``cycle.resume()`` on every rank.
- ``overlap=True`` (the default): the optimizer state (and kept grads) start copying to the host
  on a side stream before the weights stream; the offload phase copies the params and, once every
  params copy passed its checks and was issued, frees the optimizer state (its copies done) while
  the params' copies run. A failed sync, or a params offload that fails its checks, cancels those
  copies (waits for them, frees nothing): the state stays ON_DEVICE, exactly as without overlap. A
  failure after that point (a copy that fails on the device) leaves the optimizer state OFFLOADED,
  its bytes on the host, until the rollback below reloads it.
- ``engine_wake_kv_cache`` (a link that drives its engine's memory): every rank is OFFLOADED then;
  it stays so, and every rank's error says to call ``cycle.resume()`` on every rank.
- ``resume``: the engine's sleep, then the reload, each followed by an exchange, so no rank starts
  the next step's collectives while another one could not get its state back; a failure of either
  tells every rank to call ``cycle.resume()`` again on every rank (a no-op where the state is back).

The rank that failed re-raises its own error (or, where a call must recover, ``RecoveryNeeded``
chained from it); every other rank raises ``RankFailure`` naming it. Either error's ``recovery`` is
that call, or None when every rank is as the failed call found it. A rank that never arrives makes
the others raise ``BarrierTimeout`` after ``barrier_timeout_s``, which spends the cycle's group (its
``recovery``: make a new ``RefitCycle`` on every rank, and call its ``resume()`` where state may be
offloaded); the trainer's own process groups are never used for any of this. ``docs/failures.md``
has the table, phase by phase.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch.profiler import record_function

from refitkit.errors import InvalidInput, RecoveryNeeded, RefitError
from refitkit.offload import flush_device
from refitkit.ranks import RankGroup, abounded_barrier, bounded_barrier
from refitkit.report import PhaseRecord, RefitReport

if TYPE_CHECKING:
    from refitkit.engines.base import EngineAdapter, OffloadInFlight
    from refitkit.transfer import BucketedWeightSender

logger = logging.getLogger(__name__)

ARRIVAL = "training (every rank's arrival at refit)"  # the phase name of the exchange that opens a refit
ROLLBACK = "rollback (reloading what the failed offload left offloaded)"  # the exchange after a failed offload

# The calls that recover, as every rank's error names them (``RefitError.recovery``).
RESUME = "call cycle.resume() on every rank"
NEW_CYCLE = "make a new RefitCycle on every rank"
NEW_CYCLE_RESUME = "make a new RefitCycle on every rank and call its resume()"

# What a failure leaves, as every rank's error says it.
ROLLED_BACK = (
    "rolled back: every rank reloaded what it had offloaded, so every rank is ON_DEVICE as refit() found it "
    "and the next refit() works as is"
)
KV_ASLEEP = "every rank's state stays offloaded (the engine's weights awake, its KV cache asleep)"
NOT_RELOADED = "no rank's state was reloaded (every rank stays offloaded)"
PART_RELOADED = (
    "the ranks where the reload failed stay offloaded, every byte in their arena; the others are back on the device "
    "(resume() again reloads only what is still offloaded)"
)


class _Weights:
    """The adapter's weight stream as a plain iterator, counting what was pulled.

    Plain on purpose: whatever the sender does with the iterator it was handed (close it, drop
    it), the adapter's generator stays open, so a failed send can still be drained: every rank
    must take part in every gather.
    """

    def __init__(self, weights: Iterator[tuple[str, Any]]) -> None:
        self._weights = weights
        self.pulled = 0
        # the adapter's word that its tensors stay as they are while sent (``HeldWeights``), passed on to the sender
        self.refitkit_holds_tensors = getattr(weights, "refitkit_holds_tensors", False) is True
        self.refitkit_fresh_tensors = getattr(weights, "refitkit_fresh_tensors", False) is True  # (``FreshWeights``)

    def __iter__(self) -> _Weights:
        return self

    def __next__(self) -> tuple[str, Any]:
        item = next(self._weights)
        self.pulled += 1
        return item

    def drain(self) -> int:
        """Iterate what is left without using it; returns how many weights that was."""
        left = 0
        for _ in self._weights:
            left += 1
        return left


class RefitCycle:
    """Runs the refit cycle for one adapter and (on the sending rank) one sender.

    ``refit(step)``: stream ``adapter.named_weights()`` through ``sender`` (ranks without a sender
    still iterate, since gathering full weights is a collective), offload the adapter, flush the
    device, and line up all ranks. ``resume(step)``: reload the adapter and line up again. Each
    returns a ``RefitReport``; ``arefit`` / ``aresume`` are the same for event loops. It calls
    ``adapter.offload()`` / ``reload()``, never the ambiguous ``to()``. ``overlap``: copy the
    optimizer state to the host while the weights stream (off: one phase after the other).
    Every phase is a ``torch.profiler.record_function`` range named ``refitkit.<phase>``.

    Making a cycle is collective when ``torch.distributed`` is initialised: every rank of ``group``
    (default: all ranks) makes one, in the same order, which creates the cycle's gloo group.
    """

    def __init__(
        self,
        adapter: EngineAdapter,
        sender: BucketedWeightSender | None = None,
        *,
        group: Any = None,
        barrier_timeout_s: float = 300.0,
        on_phase: Callable[[str], None] | None = None,
        overlap: bool = True,
    ) -> None:
        from refitkit.engines.base import EngineAdapter

        if not isinstance(adapter, EngineAdapter):
            raise InvalidInput(
                f"RefitCycle: adapter must be an EngineAdapter (e.g. FSDPAdapter), got a {type(adapter).__name__}"
            )
        if sender is not None and not callable(getattr(sender, "send", None)):
            raise InvalidInput(f"RefitCycle: sender must have a send(weights) method, got a {type(sender).__name__}")
        if not isinstance(overlap, bool):
            raise InvalidInput(f"RefitCycle: overlap= must be a bool, got {overlap!r}")
        self.adapter = adapter
        self.sender = sender
        self.overlap = overlap
        self.group = group
        self.ranks = RankGroup(group, timeout_s=barrier_timeout_s)
        if sender is None and self.ranks.size == 1:
            logger.warning(
                "RefitCycle on a single rank without a sender: refit() offloads %s but sends its weights nowhere "
                "(pass a BucketedWeightSender or an engine link to sync them)",
                type(adapter).__name__,
            )
        self.barrier_timeout_s = self.ranks.timeout_s
        self.on_phase = on_phase  # e.g. RSSWatchdog.mark, to sample at every phase boundary

    def refit(self, step: int) -> RefitReport:
        """Sync weights, offload everything, flush the device, barrier; raises on every rank if any failed.

        A refit that raised leaves every rank ON_DEVICE, as it found them (a failed offload is rolled back), unless
        its error's ``recovery`` names the call to make on every rank (``cycle.resume()``, e.g. after the engine's KV
        cache could not wake). With a link that drives its engine's memory (``VllmLink(sleep_level=...)``) the
        sending rank first wakes the engine's weights (phase ``engine_wake_weights``, while the optimizer copies
        already run) and, after the barrier, its KV cache (``engine_wake_kv_cache``).
        """
        records: list[PhaseRecord] = []
        origin = time.perf_counter()
        failures: list[BaseException] = []
        woken: list[BaseException] = []  # a failed wake of the engine's weights, exchanged in the sync's outcome
        started: list[OffloadInFlight | BaseException] = []  # optimizer copies started before the sync
        wake = _memory_step(self.sender, "wake_for_sync")

        def begin_offload() -> None:
            if self.overlap and not started:  # timed with what it overlaps: issuing the copies can wait for queue room
                with record_function("refitkit.offload_start"):
                    started.append(_begun(self.adapter))

        def wake_weights() -> None:
            begin_offload()  # the optimizer copies run while the engine maps its weights back
            _attempt(wake, woken)  # type: ignore[arg-type]

        def sync_weights() -> int:
            begin_offload()
            return self._sync_weights(woken)

        try:
            if wake is not None:
                records.append(self._timed("engine_wake_weights", origin, wake_weights))
            records.append(self._timed("sync_weights", origin, sync_weights))
        except BaseException as error:
            self._cancel(started[0] if started else None, error)
            raise
        early = started[0] if started else None
        records.append(self._timed("offload", origin, lambda: _attempt(lambda: self._offload(early), failures)))
        records.append(self._timed("flush_device", origin, lambda: _attempt(flush_device, failures)))
        records.append(self._timed("barrier", origin, lambda: self._settle_offload(failures)))
        # Only now may the engine take its KV cache back: every rank has offloaded and flushed.
        records.extend(self._engine_phase("engine_wake_kv_cache", "wake_for_rollout", origin, stranded=KV_ASLEEP))
        return RefitReport(step=step, rank=self.ranks.rank, phases=tuple(records))

    def resume(self, step: int, *, defer_optimizer: bool = False) -> RefitReport:
        """Bring the training state back to the device, then line up; raises on every rank if any failed.

        Its failures (the engine's sleep, a rank's reload) tell every rank to call ``resume()`` again on every rank
        (``recovery``): it reloads only what is still offloaded.

        ``defer_optimizer``: return once the params and grads are back; the optimizer state arrives
        behind the caller and the optimizer's step, ``state_dict()`` and ``load_state_dict()`` wait for it
        (``adapter.reload(defer_optimizer=True)``). The reload phase's bytes are then those back on
        return. A failure of the deferred copies is raised there, on that rank, after this exchange:
        the other ranks do not learn of it.
        """
        origin = time.perf_counter()
        failures: list[BaseException] = []

        def reload() -> int:
            return self.adapter.reload(defer_optimizer=defer_optimizer).total.bytes

        # The engine releases its memory first, on every rank's device, before any rank's state comes back.
        sleep_records = self._engine_phase("engine_sleep", "sleep_for_training", origin, stranded=NOT_RELOADED)
        reload_record = self._timed("reload", origin, lambda: _attempt(reload, failures))
        barrier_record = self._timed(
            "barrier", origin, lambda: self._settle("reload", failures, stranded=PART_RELOADED)
        )
        return RefitReport(step=step, rank=self.ranks.rank, phases=(*sleep_records, reload_record, barrier_record))

    async def arefit(self, step: int) -> RefitReport:
        """``refit()`` for event loops: the cycle (copies and collectives) runs in a worker thread."""
        return await asyncio.to_thread(_on_callers_device(self.refit), step)

    async def aresume(self, step: int, *, defer_optimizer: bool = False) -> RefitReport:
        """``resume()`` for event loops: the cycle runs in a worker thread."""
        return await asyncio.to_thread(_on_callers_device(self.resume), step, defer_optimizer=defer_optimizer)

    def close(self) -> None:
        """Destroy the cycle's gloo group (every rank closes its cycle); the cycle cannot run afterwards."""
        self.ranks.close()

    def __enter__(self) -> RefitCycle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- phases -----------------------------------------------------------------------------------

    def _offload(self, flight: OffloadInFlight | BaseException | None) -> int:
        """The offload phase: the params, and inside their move (once its checks passed and its copies were issued)
        the optimizer state started before the sync, freed while the params' copies run. A params offload that fails
        its checks cancels those copies, so that failure leaves every part on the device, as without overlap."""
        if flight is None:
            return self.adapter.offload().total.bytes
        if isinstance(flight, BaseException):
            raise flight  # nothing moved: every part is still on the device
        rest = {part: part not in flight.parts for part in ("optimizer", "grad")}  # the parts not in flight
        try:
            # the flight is finished inside the params' move, its storages freed while the params' copies run
            moved = self.adapter.offload(model=True, finishing=flight, **rest).total.bytes
        except BaseException as error:
            self._cancel(flight, error)  # (a no-op once the flight was finished)
            raise
        if flight.finished is None:  # offload() finishes it or raises: copies must not outlive the phase
            error = RefitError("RefitCycle: the params' offload returned without finishing the optimizer's copies")
            self._cancel(flight, error)
            raise error
        return moved + flight.finished.total.bytes

    def _settle_offload(self, failures: list[BaseException]) -> None:
        """The offload's exchange (the barrier). Where the offload or flush failed on any rank, every rank reloads what
        it offloaded before raising, then a second exchange tells every rank whether that rollback worked everywhere:
        if so the failed refit() leaves every rank ON_DEVICE and nothing is to be called; if not, every rank's error
        names ``cycle.resume()`` on every rank (it reloads where the rollback failed, a no-op elsewhere)."""
        mine = failures[0] if failures else None
        try:
            statuses = self.ranks.exchange("offload", mine, if_lost=NEW_CYCLE)
        except RefitError as lost:  # some rank never came: nothing more can be exchanged, roll back alone
            self._roll_back_alone(lost, mine)
        if all(status.ok for status in statuses):
            return
        undo: list[BaseException] = []
        _attempt(self._roll_back, undo)
        own = mine if mine is not None else (undo[0] if undo else None)
        try:
            back = self.ranks.exchange(ROLLBACK, undo[0] if undo else None, if_lost=NEW_CYCLE_RESUME)
        except RefitError as lost:  # which ranks are back is unknown: the resume of a new cycle reloads the rest
            if mine is not None and undo and hasattr(lost, "add_note"):  # (Python 3.11+)
                lost.add_note(f"refitkit: rolling back on this rank failed too: {undo[0]!r}")
            if own is not None:
                raise lost from own
            raise
        stranded = [status for status in back if not status.ok]
        if stranded:
            which = ", ".join(str(status.rank) for status in stranded)
            outcome = (
                f"rolling back (every rank reloading what it had offloaded) failed on rank(s) {which}, "
                "which stay offloaded"
            )
            self.ranks.raise_failures("offload", statuses + stranded, own, recovery=RESUME, outcome=outcome)
        self.ranks.raise_failures("offload", statuses, mine, outcome=ROLLED_BACK)

    def _roll_back(self) -> int:
        """Reload what a failed refit left offloaded on this rank (a no-op where nothing is)."""
        return self.adapter.reload().total.bytes

    def _roll_back_alone(self, lost: RefitError, mine: BaseException | None) -> NoReturn:
        """After an offload exchange that some rank never came to: reload here, then raise ``lost``. Every rank that
        gives up on that exchange does the same, so a new cycle is all that is needed, unless the reload failed."""
        undo: list[BaseException] = []
        _attempt(self._roll_back, undo)
        if undo:
            failed = undo[0]
            said = f"{type(failed).__name__}: {failed}"
            raise RecoveryNeeded(
                f"{lost}; rolling back on rank {self.ranks.rank} failed too ({said}), its state stays offloaded: "
                f"{NEW_CYCLE_RESUME}",
                failures={self.ranks.rank: said},
                recovery=NEW_CYCLE_RESUME,
            ) from (mine if mine is not None else failed)
        if mine is not None:
            raise lost from mine
        raise lost

    def _cancel(self, flight: OffloadInFlight | BaseException | None, error: BaseException) -> None:
        """A phase failed: wait for the optimizer copies and keep the optimizer state on the device."""
        if flight is not None and not isinstance(flight, BaseException):
            try:
                self.adapter.cancel_offload(flight)
            except Exception as cancel_error:
                error.add_note(
                    f"refitkit: waiting for the optimizer copies after this failure failed too: {cancel_error!r}"
                )

    def _sync_weights(self, earlier: list[BaseException]) -> int:
        """The sync phase; ``earlier``: this rank's failure before it (waking the engine), exchanged in its outcome."""
        # Line up before the first gather: a rank that never calls refit() (it crashed in its step, or hangs)
        # then gives the others BarrierTimeout after barrier_timeout_s, not a wait inside the trainer's
        # (NCCL) all-gather until its watchdog kills the process. One small gloo exchange per refit.
        self.ranks.settle(ARRIVAL, None, if_lost=NEW_CYCLE)
        failures: list[BaseException] = list(earlier)
        weights = _Weights(iter(self.adapter.named_weights()))
        if self.sender is None or failures:
            _attempt(weights.drain, failures)  # take part in the gathers; another rank sends
            moved = 0
        else:
            moved = _attempt(lambda: self.sender.send(weights).bytes, failures)  # type: ignore[union-attr]
            if failures:
                # The other ranks are inside the gathers: finish them without sending, then tell them.
                left = _attempt(weights.drain, failures)
                if len(failures) > 1:  # the drain failed too (a collective error): keep it with the first
                    failures[0].add_note(f"refitkit: draining named_weights() after it failed too: {failures[1]!r}")
                logger.warning(
                    "rank %d: weight sync failed after %d weights (%s); iterated the %d left so every rank "
                    "finishes its gathers",
                    self.ranks.rank,
                    weights.pulled,
                    failures[0],
                    left,
                )
        self._settle("sync_weights", failures)
        return moved

    def _engine_phase(self, name: str, method: str, origin: float, *, stranded: str) -> list[PhaseRecord]:
        """The link's ``method`` on the sending rank (a link that drives the engine's memory; other senders have
        none), then every rank learns its outcome in one bounded exchange (``stranded`` as for ``_settle``); the
        phase's record where it ran."""
        failures: list[BaseException] = []
        call = _memory_step(self.sender, method)
        if call is None:  # no engine memory to drive here; the sending rank may still have some
            self._settle(name, failures, stranded=stranded)
            return []

        def run() -> None:
            _attempt(call, failures)
            self._settle(name, failures, stranded=stranded)

        return [self._timed(name, origin, run)]

    def _settle(self, phase: str, failures: list[BaseException], *, stranded: str | None = None) -> None:
        """Exchange this rank's outcome of ``phase``; raise on every rank if any rank failed.

        ``stranded``: what a failure of this phase leaves that only ``resume()`` brings back (None: nothing, every
        rank is as the call found it); every rank's error then says it and names ``cycle.resume()`` on every rank
        (a new cycle's, when the exchange itself failed).
        """
        error = failures[0] if failures else None
        if stranded is None:
            self.ranks.settle(phase, error, if_lost=NEW_CYCLE)
        else:
            self.ranks.settle(phase, error, recovery=RESUME, outcome=stranded, if_lost=NEW_CYCLE_RESUME)

    def _timed(self, name: str, origin: float, fn: Callable[[], int | None]) -> PhaseRecord:
        start = time.perf_counter()
        with record_function(f"refitkit.{name}"):
            moved = fn() or 0
        end = time.perf_counter()
        if self.on_phase is not None:
            self.on_phase(name)
        logger.debug("refit phase %s: %.3f ms, %d bytes", name, (end - start) * 1e3, moved)
        return PhaseRecord(name=name, start_s=start - origin, seconds=end - start, bytes=moved)


def _memory_step(sender: Any, method: str) -> Callable[[], Any] | None:
    """The link's ``method`` when the link drives its engine's memory (``drives_memory``, e.g. ``VllmLink(sleep_level=...)``)."""
    call = getattr(sender, method, None)
    return call if callable(call) and getattr(sender, "drives_memory", False) else None


def _begun(adapter: EngineAdapter) -> OffloadInFlight | BaseException:
    """``adapter.begin_offload()``, or its error (raised in the offload phase, whose outcome all ranks exchange)."""
    try:
        return adapter.begin_offload()
    except Exception as error:
        return error


def _on_callers_device(fn: Callable[..., RefitReport]) -> Callable[..., RefitReport]:
    """``fn`` run with the caller's current CUDA device: a new thread starts on device 0, where the flush and
    any pinning would otherwise sync and make a context on every rank of a multi-GPU host."""
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def run(*args: Any, **kwargs: Any) -> RefitReport:
        if device is not None:
            torch.cuda.set_device(device)
        return fn(*args, **kwargs)

    return run


def _attempt(fn: Callable[[], int | None], failures: list[BaseException]) -> int:
    """``fn()``'s bytes; an exception is recorded in ``failures`` (to be exchanged with the other ranks), not raised."""
    try:
        return fn() or 0
    except Exception as exc:
        failures.append(exc)
        return 0


__all__ = ["RefitCycle", "abounded_barrier", "bounded_barrier"]
