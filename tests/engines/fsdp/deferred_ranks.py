"""Rank functions for the deferred-reload tests: FSDP2 over gloo, resumed with the optimizer state deferred."""

from __future__ import annotations

import threading

from refitkit.engines import DeviceState
from refitkit.engines.fsdp import FSDPAdapter
from refitkit.refit import RefitCycle
from tests.engines.fsdp.ranks import build, local_state, train_step
from tests.helpers.bits import bits_equal

GATE_S = 60.0  # bound on a held-back copy's wait (never reached when the test passes)


def deferred_resume_matches_serial(rank: int, world_size: int) -> dict:
    """Serial: 4 steps with refit + resume between steps 2 and 3. Deferred: the same with resume(defer_optimizer=True),
    the copies held back until the first step after resume has run its forward and backward."""
    base_model, base_opt = build(world_size, fsdp=True, mixed_precision=False)
    base_losses = [train_step(base_model, base_opt, rank, s) for s in range(2)]
    with RefitCycle(FSDPAdapter(base_model, base_opt), None, barrier_timeout_s=60.0) as cycle:
        cycle.refit(step=1)
        cycle.resume(step=1)
    base_losses += [train_step(base_model, base_opt, rank, s) for s in range(2, 4)]

    model, optimizer = build(world_size, fsdp=True, mixed_precision=False)
    losses = [train_step(model, optimizer, rank, s) for s in range(2)]
    adapter = FSDPAdapter(model, optimizer)
    gate = threading.Event()
    adapter._deferred_before_copy = lambda name: gate.wait(GATE_S)
    seen: dict = {}

    def at_step_start(opt, args, kwargs):  # runs before the adapter's hook: the state is provably not back
        if not seen:
            seen["optimizer_device_bytes"] = adapter.state_bytes().optimizer.device_bytes
            gate.set()

    mine = optimizer.register_step_pre_hook(at_step_start)
    with RefitCycle(adapter, None, barrier_timeout_s=60.0) as cycle:
        cycle.refit(step=1)
        report = cycle.resume(step=1, defer_optimizer=True)
        arriving = adapter.part_states.optimizer is DeviceState.ARRIVING
        losses += [train_step(model, optimizer, rank, s) for s in range(2, 4)]
    mine.remove()
    final, base_final = local_state(model, optimizer), local_state(base_model, base_opt)
    return {
        "arriving_after_resume": arriving,
        "on_device_after_step": adapter.part_states.optimizer is DeviceState.ON_DEVICE,
        "hooks_left": len(optimizer._optimizer_step_pre_hooks),
        "optimizer_device_bytes_at_step": seen.get("optimizer_device_bytes"),
        "reload_bytes": report.phase("reload").bytes,
        "model_bytes": adapter.state_bytes().model.device_bytes,
        "losses_equal": losses == base_losses,
        "state_equal": sorted(final) == sorted(base_final) and all(bits_equal(final[k], base_final[k]) for k in final),
    }
