"""Overlapped offload: ``begin_offload`` starts the optimizer-state copies on a side stream,
``finish_offload`` / ``cancel_offload`` end them (``RefitCycle(overlap=True)`` streams weights meanwhile)."""

from __future__ import annotations

from dataclasses import dataclass

from refitkit.engines._states import AdapterMove, DeviceState, NamedTensors
from refitkit.offload.arena import HostArena
from refitkit.offload.overlapped import OffloadCopies, cancel_offload, finish_offload, start_offload


@dataclass
class OffloadInFlight:
    """``begin_offload()``'s copies of the optimizer state (and kept grads), not finished yet."""

    parts: list[str]
    keep_grads: bool
    optimizer_named: NamedTensors
    grad_named: NamedTensors
    copies: OffloadCopies


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
        optimizer_named = self._optimizer_tensors() if "optimizer" in wanted else []
        grad_named = self._grads_to_keep() if "grad" in wanted and keep else []
        copies = start_offload(optimizer_named + grad_named, self.arena)
        return OffloadInFlight(wanted, keep, optimizer_named, grad_named, copies)

    def finish_offload(self, flight: OffloadInFlight) -> AdapterMove:
        """Wait for ``begin_offload``'s copies (one synchronize), free their storages, mark the parts OFFLOADED."""
        total = finish_offload(flight.copies)
        named_by_part = {"optimizer": flight.optimizer_named, "grad": flight.grad_named}
        self._mark_offloaded(flight.parts, flight.keep_grads, named_by_part)
        return self._split(total, [], flight.optimizer_named, flight.grad_named)

    def cancel_offload(self, flight: OffloadInFlight) -> None:
        """Wait for ``begin_offload``'s copies and keep every part on the device, as if it never started."""
        cancel_offload(flight.copies)
