"""Rank function: deferred optimizer reload through torchtitan's OptimizersContainer (llama3 debug model, gloo)."""

from __future__ import annotations

import threading

from tests.engines.torchtitan.ranks import _all_equal, build, local_state, train_step

GATE_S = 60.0  # bound on a held-back copy's wait (never reached when the test passes)


def deferred_through_the_container(rank: int, world_size: int) -> dict:
    """Reference: 4 steps with offload + reload after step 2. Deferred: reload(defer_optimizer=True), the copies
    held until the container's step reached its inner optimizers' hooks."""
    from refitkit.engines import DeviceState
    from refitkit.engines.torchtitan import TorchTitanAdapter

    model_parts, optimizers, loss_fn = build(world_size)
    reference_losses = [train_step(model_parts, optimizers, loss_fn, rank, s) for s in range(2)]
    plain = TorchTitanAdapter(model_parts, optimizers)
    plain.offload()
    plain.reload()
    reference_losses += [train_step(model_parts, optimizers, loss_fn, rank, s) for s in range(2, 4)]
    reference = local_state(model_parts, optimizers)

    model_parts, optimizers, loss_fn = build(world_size)
    losses = [train_step(model_parts, optimizers, loss_fn, rank, s) for s in range(2)]
    adapter = TorchTitanAdapter(model_parts, optimizers)
    adapter.offload()
    gate = threading.Event()
    adapter._deferred_before_copy = lambda name: gate.wait(GATE_S)
    seen: dict = {}

    def at_container_step(opt, args, kwargs):  # the container's own pre-hook runs before its inner steps
        seen["optimizer_bytes"] = adapter.state_bytes().optimizer.device_bytes
        gate.set()

    mine = optimizers.register_step_pre_hook(at_container_step)
    adapter.reload(defer_optimizer=True)
    seen["arriving"] = adapter.part_states.optimizer is DeviceState.ARRIVING
    losses.append(train_step(model_parts, optimizers, loss_fn, rank, 2))
    mine.remove()
    losses.append(train_step(model_parts, optimizers, loss_fn, rank, 3))
    final = local_state(model_parts, optimizers)
    seen["on_device"] = adapter.part_states.optimizer is DeviceState.ON_DEVICE
    seen["hooks_left"] = sum(len(o._optimizer_step_pre_hooks) for o in optimizers.optimizers)
    seen["losses_equal"] = losses == reference_losses
    seen["state_equal"] = _all_equal(final, reference)
    return seen
