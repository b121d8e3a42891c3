"""Megatron optimizers: fp32 master copies and optimizer state, offloaded / loaded through refitkit.offload.

Works on a ``DistributedOptimizer``, ``Float16OptimizerWithFloat16Params``, ``FP32Optimizer``
or a ``ChainedOptimizer`` of them; anything else is refused before a byte moves.
"""

from __future__ import annotations

import logging

import torch

from refitkit.engines.megatron import _internals
from refitkit.engines.megatron._arenas import arena_groups
from refitkit.offload import MoveStats, flush_device, offload_tensors, optimizer_state_tensors, reload_tensors
from refitkit.offload.stats import EMPTY_MOVE

logger = logging.getLogger(__name__)

NamedTensors = list[tuple[str, torch.Tensor]]


def leaves(optimizer: object) -> list[object]:
    """The Megatron optimizers that own state (a ChainedOptimizer's members), each validated."""
    found = _internals.leaf_optimizers(optimizer)
    for leaf in found:
        _internals.inner_optimizer(leaf)  # raises InvalidInput for unsupported kinds
    return found


def _prefix(all_leaves: list[object], leaf: object) -> str:
    if len(all_leaves) == 1:
        return "optimizer"
    return f"optimizer.chained_optimizers[{all_leaves.index(leaf)}]"


def copy_param_tensors(members: list[object], all_leaves: list[object]) -> NamedTensors:
    """The fp32 master copies (``shard_fp32_from_float16_groups`` / ``fp32_from_float16_groups``)."""
    named: NamedTensors = []
    for leaf in members:
        prefix = _prefix(all_leaves, leaf)
        for group_index, group in enumerate(_internals.copy_param_groups(leaf)):
            for param_index, param in enumerate(group):
                if param is not None:  # None: the precision-aware optimizer holds the main param
                    named.append((f"{prefix}.copy_params[{group_index}][{param_index}]", param))
    return named


def state_tensors(members: list[object], all_leaves: list[object]) -> NamedTensors:
    """Every inner-optimizer state tensor on the params' device (exp_avg, exp_avg_sq, ...)."""
    named: NamedTensors = []
    for leaf in members:
        inner = _internals.inner_optimizer(leaf)
        if inner is not None:
            prefix = _prefix(all_leaves, leaf)
            named.extend((f"{prefix}.{name}", t) for name, t in optimizer_state_tensors(inner))
    return named


def step_optimizers(members: list[object]) -> list[torch.optim.Optimizer]:
    """The inner torch optimizers a deferred reload hooks: the first code of a Megatron step to touch state.

    ``MegatronOptimizer.step`` runs no torch step hooks of its own; before it calls the inner
    optimizer's ``step`` (``step_with_ready_grads``) it only reads and writes grads
    (``prepare_grads``, clipping, zero counting), never the fp32 main params or the state, so a
    pre-hook on each inner optimizer waits exactly in time (megatron-core 0.16.1, 0.19.2).

    Their ``state_dict`` / ``load_state_dict`` pre-hooks cover Megatron's checkpoint calls
    (megatron-core 0.16.1): ``state_dict``, ``sharded_state_dict`` and ``load_state_dict`` of the
    Float16, FP32, distributed and chained optimizers all call the inner optimizer's
    ``state_dict()`` before touching the state. Not covered: ``DistributedOptimizer``'s
    ``get_parameter_state_*`` / ``save_parameter_state`` / ``load_parameter_state*`` called on their
    own (they read ``optimizer.state`` directly; Megatron's trainer calls ``state_dict`` or
    ``load_state_dict`` first) and ``sharded_param_state_fsdp_dtensor`` (Megatron-FSDP): call
    ``adapter.wait_deferred()`` before those.
    """
    found = [_internals.inner_optimizer(leaf) for leaf in members]
    return [inner for inner in found if inner is not None]


def drop_main_grads(members: list[object]) -> None:
    """Drop the ``.grad`` of the params the inner optimizer steps on.

    Megatron rebuilds them from the grad buffers at every step, so keeping them only holds memory.
    """
    for leaf in members:
        inner = _internals.inner_optimizer(leaf)
        if inner is None:
            continue
        for group in inner.param_groups:
            for param in group["params"]:
                param.grad = None


def _move(optimizer: object, *, state: bool, offload: bool) -> MoveStats:
    all_leaves = leaves(optimizer)
    total = EMPTY_MOVE
    for arena, members in arena_groups(all_leaves):
        members = list(members)
        named = copy_param_tensors(members, all_leaves)
        if state:
            named += state_tensors(members, all_leaves)
        if offload:
            drop_main_grads(members)
            total = total + offload_tensors(named, arena)
        else:
            total = total + reload_tensors(named, arena)
    flush_device()
    return total


def offload_megatron_copy_params(optimizer: object) -> MoveStats:
    """Move the optimizer's fp32 master copies to its pinned host arena and free them on the device.

    Their ``.grad`` is dropped (rebuilt from the grad buffers at the next step). One synchronize
    + empty_cache per call; the arena is kept per leaf optimizer between calls.
    """
    stats = _move(optimizer, state=False, offload=True)
    logger.debug("offload_megatron_copy_params: %d bytes in %.4f s", stats.bytes, stats.seconds)
    return stats


def load_megatron_copy_params(optimizer: object) -> MoveStats:
    """Copy the optimizer's fp32 master copies back in place."""
    stats = _move(optimizer, state=False, offload=False)
    logger.debug("load_megatron_copy_params: %d bytes in %.4f s", stats.bytes, stats.seconds)
    return stats


def offload_megatron_optimizer(optimizer: object) -> MoveStats:
    """Move the optimizer's state (exp_avg, exp_avg_sq, ...) and its fp32 master copies to host.

    One synchronize + empty_cache per call; the arena is kept per leaf optimizer between calls.
    """
    stats = _move(optimizer, state=True, offload=True)
    logger.debug("offload_megatron_optimizer: %d bytes in %.4f s", stats.bytes, stats.seconds)
    return stats


def load_megatron_optimizer(optimizer: object) -> MoveStats:
    """Copy the optimizer's state and fp32 master copies back in place."""
    stats = _move(optimizer, state=True, offload=False)
    logger.debug("load_megatron_optimizer: %d bytes in %.4f s", stats.bytes, stats.seconds)
    return stats
