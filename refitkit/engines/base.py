"""EngineAdapter: the per-part ON_DEVICE / OFFLOADED state machine every engine adapter shares.

Engines differ only in how they enumerate their tensors. A subclass supplies four small
methods (``_model_tensors``, ``_optimizer_tensors``, ``_grad_params``, ``named_weights``) and
optionally ``_prepare_offload``; this base holds the ``HostArena``, moves everything through
``refitkit.offload`` and keeps the bookkeeping. The whole class lives here: the mechanisms it mixes in
(the replaced-tensor check, early copies, the deferred optimizer reload, the overlapped offload; their
byte moves are in ``refitkit.offload``) come first, its per-move figures (``_Bookkeeping``) last; the
state and report types live in ``_states``.
"""

from __future__ import annotations

import abc
import logging
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from refitkit._knobs import checked_seconds
from refitkit.engines._arguments import as_modules, as_optimizers, check_optimizers_own_params  # noqa: F401 (re-exported)
from refitkit.engines._states import (
    PARTS,
    AdapterMove,
    DeviceState,
    NamedTensors,
    PartBytes,
    PartStates,
    StateBytes,
)
from refitkit.engines._states import empty_move as _empty_move
from refitkit.engines._states import unique_storages as _unique_storages
from refitkit.errors import InvalidInput, OffloadedStateError, RefitError
from refitkit.offload import (
    HostArena,
    MoveStats,
    Reservation,
    offload_tensors,
    reload_grads,
    reload_tensors,
)
from refitkit.offload.arena import Slot
from refitkit.offload.deferred import BeforeCopy, DeferredReload, StepGate
from refitkit.offload.device import local_tensor
from refitkit.offload.early import RoundPlan
from refitkit.offload.moves import StorageGroup, named_tensors, reload_plan
from refitkit.offload.overlapped import OffloadCopies, cancel_offload, finish_offload, issue_early, start_offload

logger = logging.getLogger(__name__)


# -- Which storage each offloaded name held, so a reload refuses a tensor replaced while offloaded ---


class ReplacedTensorGuard:
    """``EngineAdapter``'s record of offloaded storages (a mixin: ``arena``, ``_offloaded`` and ``_held_before``
    are the adapter's)."""

    arena: HostArena
    # per part, name -> the storage offloaded under it
    _offloaded: dict[str, dict[str, tuple[int, StorageWeakRef]]]
    # per part, the records of its last offload once reloaded: the next offload of the same storages reuses
    # them. Made anew each round, a thousand records would live from one move to the next, be promoted to the
    # collector's oldest generation every round and bring the trainer's next full collection closer; freed
    # after a reload's last copy, they cost ~1 ms on an H200 host. They hold no bytes (weak references).
    _held_before: dict[str, dict[str, tuple[int, StorageWeakRef]]]

    def _held_storages(
        self,
        named: NamedTensors,
        *,
        in_flight: bool = False,
        reuse: dict[str, tuple[int, StorageWeakRef]] | None = None,
    ) -> dict[str, tuple[int, StorageWeakRef]]:
        """name -> storage for every tensor whose bytes the arena now holds (O(1) each).

        ``in_flight``: asked while an offload of all of ``named`` has its copies issued but not
        done; a storage with a slot that still has device bytes is one it is moving, so counts.
        ``reuse``: earlier records whose entry is taken as is for a name that still has the same storage (alive:
        a live weak reference keeps its key from being given to another storage).
        """
        held: dict[str, tuple[int, StorageWeakRef]] = {}
        for name, tensor in named:
            storage = local_tensor(tensor).untyped_storage()
            slot = self.arena.slot_of(storage)
            if slot is not None and (slot.holds_data or (in_flight and storage.nbytes() > 0)):
                key = storage._cdata
                record = reuse.get(name) if reuse else None
                if record is None or record[0] != key or record[1].expired():
                    record = (key, StorageWeakRef(storage))
                held[name] = record
        return held

    def _retire_held(self, parts: list[str], retired: list[str]) -> None:
        """Once a reload's checks used the records of ``parts``: keep them for the next offload to reuse, out of
        the offloaded ones. Each part is added to ``retired`` before it leaves them, for ``_hold_again``."""
        for part in parts:
            held = self._offloaded.get(part)
            if held:
                self._held_before[part] = held
                retired.append(part)
                del self._offloaded[part]

    def _hold_again(self, parts: list[str]) -> None:
        """After a reload that retired these records failed: they are the offloaded ones again (its moves were
        undone, so the storages are offloaded again, each under the name it had: the reload checked that)."""
        for part in parts:
            self._offloaded[part] = self._held_before.pop(part)

    def _check_not_replaced(self, part: str, named: NamedTensors) -> None:
        """Refuse a reload when a name now points at another tensor than the one offloaded under it.

        Restoring the new tensor's neighbours would leave the old one (still referenced, e.g. by the
        optimizer) at 0 bytes and its bytes stranded in the arena, so nothing is restored.
        """
        offloaded = self._offloaded.get(part)
        if not offloaded:
            return
        current = {name: tensor for name, tensor in named}
        replaced: list[str] = []
        for name, (key, ref) in offloaded.items():
            if ref.expired():
                continue  # nothing references the old storage any more: no bytes left to lose
            tensor = current.get(name)
            if tensor is None or local_tensor(tensor).untyped_storage()._cdata != key:
                replaced.append(name)
        if replaced:
            more = f" (and {len(replaced) - 1} more)" if len(replaced) > 1 else ""
            raise InvalidInput(
                f"{type(self).__name__}.reload(): {replaced[0]!r}{more} was replaced or removed while offloaded "
                f"(e.g. `module.weight = nn.Parameter(...)` or a new optimizer state tensor); its offloaded bytes "
                "are still in the arena and nothing was restored: put the original tensor back and call reload() again"
            )


# -- Early copies for an adapter: per set of parts moved through the arena, the plan of their last move ---


class EarlyCopies:
    """``EngineAdapter``'s round plans (a mixin: the arena and the packing knob are the adapter's)."""

    arena: HostArena
    pack_below_bytes: int

    def _round_plan(self, parts: Iterable[str]) -> RoundPlan | None:
        """The plan of the last move of exactly these parts (made empty the first time); None with packing,
        whose runs are planned per round."""
        key = tuple(sorted(parts))
        if not key or self.pack_below_bytes:
            return None
        plans: dict[tuple[str, ...], RoundPlan] = self.__dict__.setdefault("_round_plans", {})
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = RoundPlan()
        return plan


# -- Deferred optimizer reload: ``reload(defer_optimizer=True)`` copies the optimizer state back behind ---


class DeferredOptimizer:
    """``EngineAdapter``'s deferred optimizer reload (a mixin: the state and hooks are the adapter's)."""

    arena: HostArena
    _states: dict[str, DeviceState]
    _offloaded: dict[str, dict[str, tuple[int, StorageWeakRef]]]
    _gate: StepGate | None  # the optimizer hooks (step, state_dict, load_state_dict) of a deferred reload
    _deferred_before_copy: BeforeCopy | None  # tests hold deferred copies back with it

    def wait_deferred(self) -> None:
        """Wait (bounded by ``deferred_timeout_s``) for optimizer state reloaded with ``defer_optimizer=True``.

        Raises the deferred reload's failure (a ``RefitError`` naming the tensor) if it failed and
        nothing raised it yet; a no-op when nothing is arriving.
        """
        gate = self._gate
        if gate is None or gate.reported:
            return  # nothing arriving, or its failure was raised already (steps keep raising until reload)
        gate.wait()

    def _drop_failed_deferral(self) -> None:
        """Remove the hooks of a deferred reload that failed, before the optimizer state is reloaded again."""
        if self._gate is not None:
            self._gate.remove()  # a failed deferred reload's hooks: this reload replaces it
            self._gate = None

    def _start_deferred_optimizer(
        self, plan: list[tuple[StorageGroup, Slot]], step_optimizers: list[torch.optim.Optimizer], *, timeout_s: float
    ) -> DeferredReload:
        """Start copying the optimizer state back behind the caller; its step and state-dict calls wait for it."""
        deferred = DeferredReload(
            plan,
            self.arena,
            timeout_s=timeout_s,
            what=f"{type(self).__name__}'s optimizer state",
            before_copy=self._deferred_before_copy,
        )
        self._states["optimizer"] = DeviceState.ARRIVING
        self._gate = StepGate(
            deferred, step_optimizers, on_arrival=self._optimizer_arrived, on_failure=self._optimizer_failed
        )
        return deferred

    def _optimizer_arrived(self) -> None:
        self._states["optimizer"] = DeviceState.ON_DEVICE
        self._offloaded.pop("optimizer", None)
        self._gate = None

    def _optimizer_failed(self, error: RefitError) -> None:
        # the bytes are still in the arena (the storages were freed again): a plain reload() retries
        self._states["optimizer"] = DeviceState.OFFLOADED
        logger.warning("%s: deferred optimizer reload failed: %s", type(self).__name__, error)


# -- Overlapped offload: ``begin_offload`` starts the optimizer-state copies on a side stream, -----


class _MarkedWeights:
    """An adapter's weight stream with its word on how a sender may treat the tensors (the class attributes). Lazy
    like the generator it wraps: its checks run at the first item."""

    refitkit_holds_tensors = False
    refitkit_fresh_tensors = False

    def __init__(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._weights = weights

    def __iter__(self) -> _MarkedWeights:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._weights)

    def close(self) -> None:
        close = getattr(self._weights, "close", None)
        if close is not None:
            close()


class HeldWeights(_MarkedWeights):
    """An adapter's weight stream whose tensors are the model's own, yielded as they are: they stay unchanged while a
    sender pulls the rest, so it may batch their small copies and, with ``direct=True``, let the engine read them
    where they lie (``refitkit_holds_tensors``)."""

    refitkit_holds_tensors = True


class FreshWeights(_MarkedWeights):
    """An adapter's weight stream whose tensors are made for the caller (gathered, e.g. an FSDP2 ``full_tensor()``)
    or are the model's own as they are: nothing else writes one after it was yielded, so a sender that keeps it may
    let the engine read it where it lies until it lets go (``refitkit_fresh_tensors``). Unlike ``HeldWeights`` the
    tensors die once dropped, so a sender keeps each only while it is needed (small copies are not deferred)."""

    refitkit_fresh_tensors = True


@dataclass
class OffloadInFlight:
    """``begin_offload()``'s copies of the optimizer state (and kept grads), not finished yet."""

    parts: list[str]
    keep_grads: bool
    optimizer_named: NamedTensors
    grad_named: NamedTensors
    copies: OffloadCopies
    owner: weakref.ref[Any] | None = None  # the adapter that began it (only it may finish or cancel it)
    finished: AdapterMove | None = None  # what it moved, once ``offload(finishing=...)`` finished it


class OverlappedOffload:
    """``EngineAdapter``'s begin / finish / cancel offload (a mixin: the state and hooks are the adapter's)."""

    arena: HostArena
    keep_grads: bool

    def begin_offload(
        self, *, optimizer: bool = True, grad: bool = True, keep_grads: bool | None = None
    ) -> OffloadInFlight:
        """Start copying the optimizer state (and kept grads) to the arena on a side stream; frees nothing.

        For overlapping those copies with other work (``RefitCycle(overlap=True)`` streams the
        weights meanwhile). ``finish_offload`` waits for them, frees the storages and marks the
        parts OFFLOADED; ``cancel_offload`` waits and leaves everything ON_DEVICE. Nothing may
        write the optimizer state or the grads in between.
        """
        keep = self.keep_grads if keep_grads is None else keep_grads
        self.wait_deferred()  # state still arriving from a deferred reload must land before it is copied out
        wanted = self._pending({"optimizer": optimizer, "grad": grad}, DeviceState.ON_DEVICE)
        if wanted:
            self._prepare_offload(wanted)
        # the last round's largest copies first: the copy engine runs while this round is listed and checked
        plan = self._round_plan(part for part in wanted if part != "grad" or keep)
        try:
            early = issue_early(plan, self.arena)
            optimizer_named = self._optimizer_tensors() if "optimizer" in wanted else []
            grad_named = self._grads_to_keep() if "grad" in wanted and keep else []
        except BaseException:
            if plan is not None:
                plan.cancel()  # the early copies are waited for: none writes after the error
            raise
        copies = start_offload(optimizer_named + grad_named, self.arena, stream=early, plan=plan)
        return OffloadInFlight(wanted, keep, optimizer_named, grad_named, copies, owner=weakref.ref(self))

    def finish_offload(self, flight: OffloadInFlight) -> AdapterMove:
        """Wait for ``begin_offload``'s copies (one synchronize), free their storages, mark the parts OFFLOADED."""
        self._checked_flight(flight, "finish_offload")
        total = finish_offload(flight.copies)
        named_by_part = {"optimizer": flight.optimizer_named, "grad": flight.grad_named}
        self._mark_offloaded(flight.parts, flight.keep_grads, named_by_part)
        return self._split(total, [], flight.optimizer_named, flight.grad_named)

    def cancel_offload(self, flight: OffloadInFlight) -> None:
        """Wait for ``begin_offload``'s copies and keep every part on the device, as if it never started."""
        self._checked_flight(flight, "cancel_offload")
        cancel_offload(flight.copies)

    def _checked_flight(self, flight: Any, what: str, *, open_only: bool = False) -> None:
        """Refuse what is not this adapter's ``begin_offload()`` (another adapter's would free its storages and mark
        this one's parts), or, with ``open_only``, one already finished or cancelled."""
        name = type(self).__name__
        if not isinstance(flight, OffloadInFlight):
            raise InvalidInput(f"{name}.{what}: expected begin_offload()'s result, got {flight!r}")
        if flight.owner is None or flight.owner() is not self:
            raise InvalidInput(f"{name}.{what}: this offload was begun by another adapter; finish or cancel it there")
        if open_only and not flight.copies.open:
            raise InvalidInput(f"{name}.{what}: this offload was already finished or cancelled")


class EngineAdapter(OverlappedOffload, DeferredOptimizer, ReplacedTensorGuard, EarlyCopies, abc.ABC):
    """Offload / reload of one engine's training state, with an explicit state per part.

    ``keep_grads``: on offload, keep grads by copying them to host (default: drop them, as
    ``zero_grad(set_to_none=True)`` would). ``zero_grads``: on reload, give every trainable param
    a zero grad (default: restore kept grads, leave dropped ones ``None``). Both can be
    overridden per call. ``arena``: share one ``HostArena`` between adapters (default: own one).
    ``deferred_timeout_s``: how long a step (or an adapter call) waits for optimizer state reloaded
    with ``defer_optimizer=True`` before ``DeferredTimeout``; an attribute, also a ``reload()`` knob.
    ``pack_below_bytes`` (attribute, default 0 = off): see ``offload_tensors``.
    """

    deferred_timeout_s: float = 300.0
    pack_below_bytes: int = 0  # storages below this move in one copy per run of back-to-back slots (0: off)
    # Unkept grads are freed while the offload's copies run (nothing copies them), not after the last
    # one: a thousand ``.grad = None`` cost ~1 ms on an H200 host. An engine whose grad memory may still
    # be read by an unfinished reduction says False, and frees them after the phase's synchronize.
    _drops_grads_while_copying: bool = True

    def __init__(
        self,
        *,
        arena: HostArena | None = None,
        keep_grads: bool = False,
        zero_grads: bool = False,
    ) -> None:
        name = type(self).__name__
        if arena is not None and not isinstance(arena, HostArena):
            raise InvalidInput(
                f"{name}: arena= must be a refitkit.offload.HostArena or None, got {type(arena).__name__}"
            )
        for knob, value in (("keep_grads", keep_grads), ("zero_grads", zero_grads)):
            if not isinstance(value, bool):
                raise InvalidInput(f"{name}: {knob}= must be a bool, got {value!r}")
        self.arena = arena if arena is not None else HostArena()
        self.keep_grads = keep_grads
        self.zero_grads = zero_grads
        self._states: dict[str, DeviceState] = {part: DeviceState.ON_DEVICE for part in PARTS}
        self._grads_kept = False
        self._gate: StepGate | None = None  # a deferred reload's optimizer hooks (step, state_dict, load_state_dict)
        self._deferred_before_copy: BeforeCopy | None = None  # tests hold deferred copies back with it
        # per part, name -> the storage offloaded under it: a tensor replaced while offloaded is caught
        self._offloaded: dict[str, dict[str, tuple[int, StorageWeakRef]]] = {}
        self._held_before: dict[str, dict[str, tuple[int, StorageWeakRef]]] = {}  # (see ReplacedTensorGuard)
        self._guard: _OffloadGuard | None = None  # refuses forward / state_dict / step while state is offloaded

    # --- what an engine supplies -------------------------------------------------------------

    @abc.abstractmethod
    def _model_tensors(self) -> NamedTensors:
        """Every param and buffer that holds device memory (sharded params as DTensors or locals)."""

    @abc.abstractmethod
    def _optimizer_tensors(self) -> NamedTensors:
        """Every optimizer state tensor that lives with the params."""

    @abc.abstractmethod
    def _grad_params(self) -> NamedTensors:
        """The (name, param) pairs whose ``.grad`` belongs to this adapter."""

    @abc.abstractmethod
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights as (name, tensor), one at a time, for streaming to inference."""

    def _prepare_offload(self, parts: list[str]) -> None:
        """Bring the engine to a state whose tensors can be enumerated (e.g. FSDP reshard)."""

    def _model_tensors_to_move(self) -> NamedTensors:
        """The model tensors offload copies and reload restores; an engine may drop and rebuild the rest."""
        return self._model_tensors()

    def _model_tensors_to_reserve(self) -> NamedTensors:
        """The model tensors ``prepare()`` sizes host bytes for: those an offload is expected to copy."""
        return self._model_tensors()

    def _after_offload(self, parts: list[str]) -> None:
        """Runs once the offload's copies are done and the parts are marked OFFLOADED (a raise leaves them so)."""

    def _check_reload(self, *, model: bool, optimizer: bool, defer_optimizer: bool) -> None:
        """Refuse a reload this engine cannot do, before anything moves (e.g. Megatron's rebuilt params)."""

    def _after_reload(self, parts: list[str]) -> None:
        """Runs once the reload's copies are done (grads too), before the parts are marked ON_DEVICE."""

    def _step_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers whose ``step`` (and ``state_dict``/``load_state_dict``) a deferred reload hooks to wait."""
        return []

    def _guarded_modules(self) -> list[torch.nn.Module]:
        """The root modules whose forward and ``state_dict()`` are refused while the model part is offloaded."""
        return []

    # --- grads: where an engine keeps them (default: ``param.grad``) ------------------------

    def _grads_to_keep(self) -> NamedTensors:
        """The grad tensors copied to the arena when grads are kept."""
        return [(f"{name}.grad", p.grad) for name, p in self._grad_params() if p.grad is not None]

    def _drop_grads(self) -> None:
        """Free the grads without a copy (after the phase's synchronize)."""
        for _, param in self._grad_params():
            param.grad = None  # as zero_grad(set_to_none=True) would

    def _grads_to_restore(self, zero: bool) -> NamedTensors:
        """The kept grad tensors copied back in the reload phase (none when they are zeroed instead)."""
        return self._grads_to_keep() if self._grads_kept and not zero else []

    def _after_grad_reload(self, zero: bool) -> None:
        """Finish the grad part of a reload (default: zero grads on request)."""
        if zero:
            reload_grads(self._grad_params(), self.arena, zero=True)

    # --- state -----------------------------------------------------------------------------

    @property
    def state(self) -> DeviceState:
        """ON_DEVICE when a train step can run: every part on the device or ARRIVING (the step waits for it)."""
        if all(s in (DeviceState.ON_DEVICE, DeviceState.ARRIVING) for s in self._states.values()):
            return DeviceState.ON_DEVICE
        return DeviceState.OFFLOADED

    @property
    def part_states(self) -> PartStates:
        """The state of each part separately."""
        return PartStates(**self._states)

    @property
    def device(self) -> torch.device:
        """The device the model's storages live on (they keep it across offload and reload)."""
        for _name, tensor in self._model_tensors():
            return local_tensor(tensor).device
        raise InvalidInput(f"{type(self).__name__}: the model has no parameters or buffers to offload")

    def state_bytes(self) -> StateBytes:
        """Per-part bytes on the device and in the host arena right now."""
        grads = [(f"{name}.grad", p.grad) for name, p in self._grad_params() if p.grad is not None]
        return StateBytes(
            model=self._part_bytes(self._model_tensors()),
            optimizer=self._part_bytes(self._optimizer_tensors()),
            grad=self._part_bytes(grads),
            arena_bytes=self.arena.nbytes,
        )

    def _part_bytes(self, named: NamedTensors) -> PartBytes:
        device_bytes = host_bytes = 0
        for storage in _unique_storages(named):
            device_bytes += storage.nbytes()
            slot = self.arena.slot_of(storage)
            if slot is not None and slot.holds_data:
                host_bytes += slot.nbytes
        return PartBytes(device_bytes=device_bytes, host_bytes=host_bytes)

    # --- transitions -----------------------------------------------------------------------

    def prepare(self, *, keep_grads: bool | None = None) -> Reservation:
        """Size the arena for every part and allocate and pin it in a background thread; returns at once.

        Call it once the storages have their training sizes (e.g. right after the first optimizer
        step, when the optimizer state exists) and let training run: the first ``offload()`` then
        waits only for what is not pinned yet (at most the arena's ``reserve_wait_s``), and raises
        the thread's error if it failed (the arena stays usable). Grads are sized when they will be
        kept. Storages that appear later get their slots at offload, as without ``prepare()``.
        """
        keep = self.keep_grads if keep_grads is None else keep_grads
        if not isinstance(keep, bool):
            raise InvalidInput(f"{type(self).__name__}.prepare(): keep_grads= must be a bool, got {keep!r}")
        named = self._model_tensors_to_reserve() + self._optimizer_tensors() + (self._grads_to_keep() if keep else [])
        return self.arena.reserve(list(_unique_storages(named)), background=True)

    def offload(
        self,
        *,
        model: bool = True,
        optimizer: bool = True,
        grad: bool = True,
        keep_grads: bool | None = None,
        finishing: OffloadInFlight | None = None,
    ) -> AdapterMove:
        """Move the chosen parts to the host arena and free their device storage; idempotent per part.

        ``finishing``: a ``begin_offload()`` of other parts, finished (``finish_offload``) inside this move once
        every check passed and every copy was issued, while those copies run: its storages are freed then, not
        after this move's last copy. What it moved is in ``finishing.finished``. A failure before that point
        leaves the flight as it was (cancel it); after it, the flight's parts are OFFLOADED whatever this move does.
        """
        keep = self.keep_grads if keep_grads is None else keep_grads
        self.wait_deferred()  # bytes still arriving must land before anything leaves again
        wanted = self._pending({"model": model, "optimizer": optimizer, "grad": grad}, DeviceState.ON_DEVICE)
        if finishing is not None:
            self._checked_flight(finishing, "offload(finishing=)", open_only=True)
            twice = sorted(set(wanted) & set(finishing.parts))
            if twice:
                raise InvalidInput(
                    f"{type(self).__name__}.offload(): {twice} already in flight (finishing=); pass them as False"
                )

        def finish_flight() -> None:  # once, at the first point where every check of this move has passed
            if finishing is not None and finishing.finished is None:
                finishing.finished = self.finish_offload(finishing)

        if not wanted:
            finish_flight()
            return _empty_move()
        self._prepare_offload(wanted)
        plan = self._round_plan(part for part in wanted if part != "grad" or keep)
        by_part: dict[str, NamedTensors] | None = None
        try:
            if plan is not None:
                plan.issue_offload(self.arena)  # last round's copies first; this round's listing runs meanwhile
            model_named = self._model_tensors_to_move() if "model" in wanted else []
            optimizer_named = self._optimizer_tensors() if "optimizer" in wanted else []
            grad_named = self._grads_to_keep() if "grad" in wanted and keep else []
            by_part = {"model": model_named, "optimizer": optimizer_named, "grad": grad_named}
            ahead = _Bookkeeping(self, by_part)
            drop_early = "grad" in wanted and not keep and self._drops_grads_while_copying
            dropped: list[bool] = []  # whether the grads went while the copies ran (not when there was nothing to copy)

            def while_copying() -> None:  # (after every check and every copy was issued)
                ahead.run(held=wanted)
                if drop_early:
                    self._drop_grads()
                    dropped.append(True)
                finish_flight()  # its copies were issued first: done before these, freed while these run

            # one call, so the phase pays one synchronize; the bookkeeping runs while the copies do
            total = offload_tensors(
                model_named + optimizer_named + grad_named,
                self.arena,
                pack_below_bytes=self.pack_below_bytes,
                while_copying=while_copying,
                plan=plan,
                ahead=model_named,  # (the order the next reload's plan follows)
            )
            finish_flight()  # (when nothing of this move's was on the device, no copy called back)
        except BaseException:
            if plan is not None:
                plan.cancel()  # early copies the offload never took: waited for
            if by_part is not None and _all_freed(by_part):  # interrupted after its copies were done: it finished
                self._mark_offloaded(wanted, keep, by_part)
            raise
        # marked before the hook: its storages are freed now, so a hook that raises must leave them
        # OFFLOADED (a reload brings them back) rather than ON_DEVICE with no bytes
        self._mark_offloaded(wanted, keep, by_part, held=ahead.held, grads_dropped=bool(dropped))
        self._after_offload(wanted)
        logger.debug("%s offloaded %s: %d bytes in %.4f s", type(self).__name__, wanted, total.bytes, total.seconds)
        return ahead.split(total)

    def _mark_offloaded(
        self,
        parts: list[str],
        keep: bool,
        named_by_part: dict[str, NamedTensors],
        *,
        held: dict[str, dict[str, tuple[int, StorageWeakRef]]] | None = None,
        grads_dropped: bool = False,
    ) -> None:
        """After an offload's copies freed the device storages: drop unkept grads, mark the parts OFFLOADED.

        ``held``: each part's held storages when already looked up while the copies ran; ``grads_dropped``:
        the unkept grads were already freed while they ran.
        """
        if "grad" in parts and not keep and not grads_dropped:
            self._drop_grads()
        if self._guard is None and ("model" in parts or "optimizer" in parts):  # hooks only while state is away
            self._guard = _OffloadGuard(self)
        for part in parts:
            self._states[part] = DeviceState.OFFLOADED
            self._offloaded[part] = held[part] if held is not None else self._held_storages(named_by_part[part])
        if "grad" in parts:
            self._grads_kept = keep

    def reload(
        self,
        *,
        model: bool = True,
        optimizer: bool = True,
        grad: bool = True,
        zero_grads: bool | None = None,
        defer_optimizer: bool = False,
        deferred_timeout_s: float | None = None,
    ) -> AdapterMove:
        """Restore the chosen parts from the host arena in place; idempotent per part.

        ``defer_optimizer``: return once the params and grads are back; the optimizer state is
        regrown and copied behind the caller (a side stream on CUDA) and the optimizer's ``step``
        waits for it, at most ``deferred_timeout_s``. Until then ``part_states.optimizer`` is
        ARRIVING and ``move.optimizer`` counts the bytes on their way (``move.total`` what is back).
        """
        zero = self.zero_grads if zero_grads is None else zero_grads
        if not isinstance(defer_optimizer, bool):
            raise InvalidInput(
                f"{type(self).__name__}.reload(): defer_optimizer= must be a bool, got {defer_optimizer!r}"
            )
        timeout_s = checked_seconds(
            self.deferred_timeout_s if deferred_timeout_s is None else deferred_timeout_s, "deferred_timeout_s"
        )
        self._check_reload(model=model, optimizer=optimizer, defer_optimizer=defer_optimizer)
        self.wait_deferred()
        wanted = self._pending({"model": model, "optimizer": optimizer, "grad": grad}, DeviceState.OFFLOADED)
        if not wanted:
            return _empty_move()
        defer = defer_optimizer and "optimizer" in wanted
        step_optimizers = self._step_optimizers() if defer else []
        if defer and not step_optimizers:
            raise InvalidInput(
                f"{type(self).__name__}.reload(defer_optimizer=True): this adapter has no optimizer whose step could "
                "wait for the state; reload without defer_optimizer"
            )
        restores = {"model": True, "optimizer": not defer, "grad": self._grads_kept and not zero}
        plan = self._round_plan(part for part in wanted if restores[part])
        retired: list[str] = []  # parts whose held-storage records the reload retired while its copies ran
        try:
            if plan is not None:
                plan.issue_reload(self.arena)  # last round's copies first; the checks below run meanwhile
            model_named = self._model_tensors_to_move() if "model" in wanted else []
            optimizer_named = self._optimizer_tensors() if "optimizer" in wanted else []
            grad_named = self._grads_to_restore(zero) if "grad" in wanted else []
            if "model" in wanted:
                self._check_not_replaced("model", model_named)
            if "optimizer" in wanted:
                self._check_not_replaced("optimizer", optimizer_named)
            if "grad" in wanted and self._offloaded.get("grad"):
                self._check_not_replaced("grad", self._grads_to_keep())
            # checked before any deferred copy starts (and before anything is marked), like the rest
            deferred_plan = reload_plan(named_tensors(optimizer_named), self.arena) if defer else []
            if "optimizer" in wanted:
                self._drop_failed_deferral()
            restored_now = [] if defer else optimizer_named  # a deferred state follows behind the caller
            ahead = _Bookkeeping(self, {"model": model_named, "optimizer": restored_now, "grad": grad_named})

            def while_copying() -> None:
                ahead.run()
                self._retire_held([part for part in wanted if part != "optimizer" or not defer], retired)

            total = reload_tensors(
                model_named + restored_now + grad_named,
                self.arena,
                pack_below_bytes=self.pack_below_bytes,
                while_copying=while_copying,
                plan=plan,
                ahead=model_named,  # (the weights a sync exports, together)
            )
        except BaseException:
            if plan is not None:
                plan.cancel()  # storages regrown early that the reload never took: freed again
            self._hold_again(retired)  # the reload undid its moves: the storages are offloaded again
            raise
        if "grad" in wanted:
            self._after_grad_reload(zero)
        self._after_reload(wanted)
        for part in wanted:
            if part == "optimizer" and defer:
                continue
            self._states[part] = DeviceState.ON_DEVICE
            self._offloaded.pop(part, None)
        if not defer:
            self._release_guard()
            logger.debug("%s reloaded %s: %d bytes in %.4f s", type(self).__name__, wanted, total.bytes, total.seconds)
            return ahead.split(total)
        deferred = self._start_deferred_optimizer(deferred_plan, step_optimizers, timeout_s=timeout_s)
        self._release_guard()  # the deferred reload's own hooks answer from here (a step waits for the state)
        logger.debug(
            "%s reloaded %s: %d bytes in %.4f s; %d optimizer bytes arriving",
            type(self).__name__,
            wanted,
            total.bytes,
            total.seconds,
            deferred.nbytes,
        )
        moved = ahead.split(total)
        arriving = MoveStats(bytes=deferred.nbytes, storages=deferred.storages, seconds=0.0)
        return AdapterMove(model=moved.model, optimizer=arriving, grad=moved.grad, total=total)

    def to(
        self, device: torch.device | str | int, *, model: bool = True, optimizer: bool = True, grad: bool = True
    ) -> AdapterMove:
        """Engine-style move: ``"cpu"`` offloads, the model's accelerator reloads; idempotent."""
        target = _as_device(device)
        if target.type == "cpu":
            return self.offload(model=model, optimizer=optimizer, grad=grad)
        home = self.device
        if home.type == "cpu":
            raise InvalidInput(
                f"{type(self).__name__}.to({str(target)!r}): this model's storages live on cpu and keep their "
                "device, so they cannot be reloaded onto an accelerator; on a CPU-only run use reload()"
            )
        if target.type != home.type or (target.index is not None and target.index != _index(home)):
            raise InvalidInput(
                f"{type(self).__name__}.to({str(target)!r}): the model's storages live on {home} and keep "
                f"their device across offload; reload with to({str(home)!r}) or reload()"
            )
        return self.reload(model=model, optimizer=optimizer, grad=grad)

    def _release_guard(self) -> None:
        """Remove the offloaded-state hooks once neither the model nor the optimizer state is offloaded."""
        if self._guard is not None and all(
            self._states[part] is not DeviceState.OFFLOADED for part in ("model", "optimizer")
        ):
            self._guard.remove()
            self._guard = None

    def _pending(self, asked: dict[str, bool], from_state: DeviceState) -> list[str]:
        for part, flag in asked.items():
            if not isinstance(flag, bool):
                raise InvalidInput(f"{type(self).__name__}: {part}= must be a bool, got {flag!r}")
        return [part for part, flag in asked.items() if flag and self._states[part] is from_state]

    def _split(
        self, total: MoveStats, model_named: NamedTensors, optimizer_named: NamedTensors, grad_named: NamedTensors
    ) -> AdapterMove:
        ahead = _Bookkeeping(self, {"model": model_named, "optimizer": optimizer_named, "grad": grad_named})
        ahead.run()
        return ahead.split(total)

    def _moved(self, named: NamedTensors) -> tuple[int, int]:
        """Bytes and storages of ``named`` that have a slot (per-part figures of a move)."""
        slots = [slot for storage in _unique_storages(named) if (slot := self.arena.slot_of(storage)) is not None]
        return sum(slot.nbytes for slot in slots), len(slots)

    def __repr__(self) -> str:
        states = ", ".join(f"{part}={state.name}" for part, state in self._states.items())
        return f"{type(self).__name__}({states}, arena={self.arena!r})"


class _OffloadGuard:
    """Refuses, with ``OffloadedStateError``, what would read or save offloaded state: a guarded module's forward and
    ``state_dict()`` while the model part is offloaded, an optimizer's ``step`` while the params or its state are, and
    its ``state_dict()`` while its state is. Installed when the model or optimizer state is offloaded and removed once
    both are back (nothing runs on a step while everything is on the device); each hook reads the adapter's part
    states at the call (the adapter is held through a weak reference: no reference cycle keeps it alive)."""

    def __init__(self, adapter: EngineAdapter) -> None:
        owner = weakref.ref(adapter)
        self.handles: list[Any] = []
        for module in adapter._guarded_modules():
            self.handles.append(
                module.register_forward_pre_hook(_refusal(owner, ("model",), f"{type(module).__name__}.forward()"))
            )
            self.handles.append(
                module.register_state_dict_pre_hook(_refusal(owner, ("model",), "the model's state_dict()"))
            )
        self.optimizers = adapter._step_optimizers()
        for optimizer in self.optimizers:
            name = type(optimizer).__name__
            _guard_step(optimizer, _refusal(owner, ("model", "optimizer"), f"{name}.step()"))
            self.handles.append(
                optimizer.register_state_dict_pre_hook(_refusal(owner, ("optimizer",), f"{name}.state_dict()"))
            )

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for optimizer in self.optimizers:
            _GUARDED_STEPS.pop(optimizer, None)


# Steps are guarded through torch's one global step pre-hook, not a hook per optimizer: an optimizer's own
# step hooks stay those of the trainer and of a deferred reload.
_GUARDED_STEPS: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()
_STEP_HOOK: list[Any] = []


def _guard_step(optimizer: torch.optim.Optimizer, refuse: Any) -> None:
    if not _STEP_HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _STEP_HOOK.append(register_optimizer_step_pre_hook(_check_step))
    _GUARDED_STEPS[optimizer] = refuse


def _check_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    refuse = _GUARDED_STEPS.get(optimizer)
    if refuse is not None:
        refuse()


def _refusal(owner: weakref.ref, parts: tuple[str, ...], what: str) -> Any:
    def refuse(*_: Any) -> None:
        adapter = owner()
        if adapter is None or adapter._gate is not None:  # gone, or a deferred reload's own hooks answer (they wait)
            return
        offloaded = [part for part in parts if adapter._states[part] is DeviceState.OFFLOADED]
        if offloaded:
            raise OffloadedStateError(
                f"{type(adapter).__name__}: {what} while the {' and '.join(offloaded)} state is offloaded (its tensors "
                "hold 0 bytes on the device: this would crash the process or read garbage). Call adapter.reload() "
                "(or RefitCycle.resume()) first"
            )

    return refuse


def _as_device(device: torch.device | str | int) -> torch.device:
    try:
        if isinstance(device, int):
            return torch.device("cuda", device)
        return torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise InvalidInput(f"to({device!r}): not a device ({error})") from None


def _index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    if device.type == "cuda":
        return torch.cuda.current_device()
    return 0


def _all_freed(by_part: dict[str, NamedTensors]) -> bool:
    """Whether an offload that raised had freed every storage (it frees them only once their copies are done)."""
    named = [tensor for part in by_part.values() for _, tensor in part]
    return bool(named) and all(local_tensor(tensor).untyped_storage().nbytes() == 0 for tensor in named)


# -- A move's per-part figures and held-storage records, looked up while its copies run (``EngineAdapter``'s helper) ---


class _Bookkeeping:
    """A move's per-part figures (and held storages), looked up while its copies run, not after them.

    Everything read here is final once the copies are issued: slot sizes are set, and a storage
    still holding bytes with a slot is one this move frees (see ``EngineAdapter._held_storages``).
    """

    def __init__(self, adapter: EngineAdapter, by_part: dict[str, NamedTensors]) -> None:
        self._adapter = adapter
        self._by_part = by_part
        self._counts: dict[str, tuple[int, int]] = {}
        self.held: dict[str, dict[str, tuple[int, StorageWeakRef]]] | None = None

    def run(self, held: list[str] | None = None) -> None:
        self._counts = {part: self._adapter._moved(named) for part, named in self._by_part.items()}
        if held is not None:
            adapter, before = self._adapter, self._adapter._held_before
            self.held = {
                part: adapter._held_storages(self._by_part[part], in_flight=True, reuse=before.pop(part, None))
                for part in held
            }

    def split(self, total: MoveStats) -> AdapterMove:
        """Per-part stats; the time is the phase's, shared."""
        if not self._counts:
            self.run()
        parts = {
            part: MoveStats(bytes=nbytes, storages=count, seconds=total.seconds if nbytes else 0.0)
            for part, (nbytes, count) in self._counts.items()
        }
        return AdapterMove(model=parts["model"], optimizer=parts["optimizer"], grad=parts["grad"], total=total)
