"""Optimizer state and gradients: which tensors they are, moved through the offload core."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

from refitkit.errors import InvalidInput
from refitkit.offload.arena import HostArena
from refitkit.offload.device import SegmentedRegrow, local_tensor
from refitkit.offload.moves import offload_tensors, regrow_tensors, reload_tensors
from refitkit.offload.stats import EMPTY_MOVE, MoveStats

NamedParams = Iterable[tuple[str, torch.Tensor]]


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Every tensor in ``optimizer.state`` that lives with the params, named for error messages.

    Host-side scalars (Adam's ``step`` on CPU next to CUDA params) stay where they are; on a
    CPU-only run every state tensor counts.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidInput(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    named: list[tuple[str, torch.Tensor]] = []
    for group_index, group in enumerate(optimizer.param_groups):
        for param_index, param in enumerate(group["params"]):
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    named.append((f"param_groups[{group_index}].params[{param_index}].{key}", value))
    accelerated = [item for item in named if item[1].device.type not in ("cpu", "meta")]
    return accelerated if accelerated else named


def offload_optimizer(optimizer: torch.optim.Optimizer, arena: HostArena) -> MoveStats:
    """Offload all of an optimizer's state tensors (exp_avg, exp_avg_sq, momentum, ...)."""
    named = optimizer_state_tensors(optimizer)
    stats = offload_tensors(named, arena)
    arena.optimizer_states[optimizer] = {name: weakref.ref(tensor) for name, tensor in named if _held(tensor, arena)}
    return stats


def reload_optimizer(optimizer: torch.optim.Optimizer, arena: HostArena) -> MoveStats:
    """Restore an optimizer's state tensors in place; refuses (restoring nothing) while a state tensor it offloaded
    into ``arena`` was replaced in, or removed from, the optimizer's state and is still alive."""
    named = optimizer_state_tensors(optimizer)
    _refuse_replaced_state(optimizer, named, arena)
    stats = reload_tensors(named, arena)
    arena.optimizer_states.pop(optimizer, None)
    return stats


def _held(tensor: torch.Tensor, arena: HostArena) -> bool:
    slot = arena.slot_of(local_tensor(tensor).untyped_storage())
    return slot is not None and slot.holds_data


def _refuse_replaced_state(
    optimizer: torch.optim.Optimizer, named: list[tuple[str, torch.Tensor]], arena: HostArena
) -> None:
    """InvalidInput naming each state tensor offloaded from ``optimizer`` that its state no longer holds under its
    name while it is still alive (e.g. kept by the caller) and offloaded: restoring the rest would leave it at 0 bytes
    with its bytes stranded in the arena. ``reload_tensors`` refuses a tensor whose storage was swapped
    (``.data = ...``); this is the same refusal for a state entry swapped for another tensor (``state["exp_avg"] =
    ...``). One that nothing references any more has nothing left to restore into: not refused."""
    offloaded = arena.optimizer_states.get(optimizer)
    if not offloaded:
        return
    current = {name: tensor for name, tensor in named}
    replaced = [
        name
        for name, ref in offloaded.items()
        if (old := ref()) is not None and current.get(name) is not old and _held(old, arena)
    ]
    if replaced:
        more = f" (and {len(replaced) - 1} more)" if len(replaced) > 1 else ""
        raise InvalidInput(
            f"{replaced[0]!r}{more} was replaced in or removed from the optimizer's state between offload and reload "
            "(the tensor offloaded under that name still exists, at 0 bytes); its offloaded bytes were kept, nothing "
            "was restored: put the original tensor back and call reload_optimizer() again"
        )


def offload_grads(params: NamedParams, arena: HostArena, *, keep: bool = False) -> MoveStats:
    """Drop every param's ``.grad`` (default), or keep it by offloading it like any tensor."""
    named = [(name, p) for name, p in params if p.grad is not None]
    if not keep:
        for _, param in named:
            param.grad = None
        return EMPTY_MOVE
    return offload_tensors([(f"{name}.grad", p.grad) for name, p in named], arena)


def reload_grads(params: NamedParams, arena: HostArena, *, zero: bool = False) -> MoveStats:
    """Restore kept grads in place; with ``zero=True`` every trainable param ends with a zero grad.

    Zeroing skips the copy of kept grads (their bytes are about to be overwritten) and allocates
    a zero grad for params whose grad was dropped, in shared segments of at most 2 GiB: a grad each
    after a flush would be a ``cudaMalloc`` each now and a ``cudaFree`` each at the next flush.
    """
    named = list(params)
    if not zero:
        return reload_tensors([(f"{name}.grad", p.grad) for name, p in named if p.grad is not None], arena)
    kept = [(f"{name}.grad", p.grad) for name, p in named if p.grad is not None]
    regrow_tensors(kept, arena, zero=False)  # zeroed just below; no copy of bytes about to be overwritten
    for _, param in named:
        if param.grad is not None:
            param.grad.zero_()
    fresh = [param for _, param in named if param.grad is None and param.requires_grad]
    segments = SegmentedRegrow(_grads_device(fresh), [_dense_bytes(param) for param in fresh])
    for index, param in enumerate(fresh):
        segments.before(index)
        param.grad = torch.zeros_like(param)
    return EMPTY_MOVE


def _grads_device(params: list[torch.Tensor]) -> torch.device | None:
    """The one device of these params' local shards (None when there are several: no shared segments then)."""
    devices = {local_tensor(param).device for param in params}
    return devices.pop() if len(devices) == 1 else None


def _dense_bytes(param: torch.Tensor) -> int:
    """The bytes of a zero grad like ``param``'s local shard."""
    local = local_tensor(param)
    return local.numel() * local.element_size()
