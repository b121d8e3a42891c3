"""Rank function: torchtitan's OptimizersContainer checkpointed while a deferred reload is ARRIVING.

The container's ``state_dict()`` / ``load_state_dict()`` (what torchtitan's checkpointer hands to DCP)
call each inner optimizer's own, whose pre-hooks wait for the deferred state.
"""

from __future__ import annotations

import copy
import threading

import torch

from tests.engines.torchtitan.ranks import _all_equal, build, local_state, train_step
from tests.helpers.bits import bits_equal

GATE_S = 60.0  # bound on a held-back copy's wait (never reached when the test passes)


def saved(optimizers) -> dict:
    """The container's flat state dict with its tensors cloned (what DCP would write now)."""
    state_dict = optimizers.state_dict()
    return {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in state_dict.items()}


def same(a: dict, b: dict) -> bool:
    if sorted(a) != sorted(b):
        return False
    return all(bits_equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def load_in_place(optimizers, checkpoint: dict) -> None:
    """torchtitan's checkpoint load: DCP writes into the container's state-dict tensors, then it loads them."""
    target = optimizers.state_dict()
    for key, value in target.items():
        if isinstance(value, torch.Tensor):
            value.copy_(checkpoint[key])
        else:
            target[key] = copy.deepcopy(checkpoint[key])
    optimizers.load_state_dict(target)


def _hook_count(optimizers) -> int:
    return sum(
        len(o._optimizer_step_pre_hooks)
        + len(o._optimizer_state_dict_pre_hooks)
        + len(o._optimizer_load_state_dict_pre_hooks)
        for o in optimizers.optimizers
    )


def checkpoint_while_arriving(rank: int, world_size: int, mode: str) -> dict:
    """``mode``: "save" (the container's state_dict right after the deferred reload), "load" (a checkpoint's
    state dict loaded then) or "dcp_load" (loaded in place, as torchtitan's checkpointer does)."""
    from refitkit.engines import DeviceState
    from refitkit.engines.torchtitan import TorchTitanAdapter

    seen: dict = {}
    if mode != "save":
        model_parts, optimizers, loss_fn = build(world_size, seed=1)  # another run: every value differs
        for step in range(3):
            train_step(model_parts, optimizers, loss_fn, rank, step)
        checkpoint = saved(optimizers)
    model_parts, optimizers, loss_fn = build(world_size)
    reference_losses = [train_step(model_parts, optimizers, loss_fn, rank, s) for s in range(2)]
    expected = saved(optimizers)
    if mode != "save":
        optimizers.load_state_dict(copy.deepcopy(checkpoint))
        reference_losses += [train_step(model_parts, optimizers, loss_fn, rank, s) for s in range(2, 4)]
    reference = local_state(model_parts, optimizers)

    model_parts, optimizers, loss_fn = build(world_size)
    losses = [train_step(model_parts, optimizers, loss_fn, rank, s) for s in range(2)]
    adapter = TorchTitanAdapter(model_parts, optimizers)
    adapter.offload()
    gate = threading.Event()
    adapter._deferred_before_copy = lambda name: gate.wait(GATE_S)

    def at_call_start(opt: torch.optim.Optimizer, *args: object) -> None:  # before the adapter's hooks
        if "optimizer_bytes" not in seen:
            seen["optimizer_bytes"] = adapter.state_bytes().optimizer.device_bytes
            gate.set()

    inner = optimizers.optimizers
    register = "register_load_state_dict_pre_hook" if mode == "load" else "register_state_dict_pre_hook"
    mine = [getattr(opt, register)(at_call_start) for opt in inner]
    adapter.reload(defer_optimizer=True)
    seen["arriving"] = adapter.part_states.optimizer is DeviceState.ARRIVING
    seen["hooked"] = _hook_count(optimizers) == 4 * len(inner)  # the adapter's three and the test's one, per optimizer
    if mode == "save":
        seen["saved_equal"] = same(saved(optimizers), expected)
    elif mode == "load":
        optimizers.load_state_dict(copy.deepcopy(checkpoint))
    else:
        load_in_place(optimizers, checkpoint)
    seen["on_device"] = adapter.part_states.optimizer is DeviceState.ON_DEVICE  # the call itself waited
    for handle in mine:
        handle.remove()
    seen["hooks_left"] = _hook_count(optimizers)
    if mode != "save":
        seen["loaded_equal"] = same(saved(optimizers), checkpoint)
        losses += [train_step(model_parts, optimizers, loss_fn, rank, s) for s in range(2, 4)]
        seen["losses_equal"] = losses == reference_losses
        seen["state_equal"] = _all_equal(local_state(model_parts, optimizers), reference)
    return seen
