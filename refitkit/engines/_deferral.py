"""Deferred optimizer reload: ``reload(defer_optimizer=True)`` copies the optimizer state back behind
the caller, and the optimizer's step, ``state_dict()`` and ``load_state_dict()`` (or the adapter's
next call, or ``wait_deferred()``) wait for it."""

from __future__ import annotations

import logging

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from refitkit.engines._states import DeviceState
from refitkit.errors import RefitError
from refitkit.offload.arena import HostArena, Slot
from refitkit.offload.deferred import BeforeCopy, DeferredReload, StepGate
from refitkit.offload.moves import StorageGroup

# the adapter's logger, as before this code moved out of base.py
logger = logging.getLogger("refitkit.engines.base")


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
