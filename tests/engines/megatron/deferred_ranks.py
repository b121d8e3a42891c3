"""Rank functions for deferred optimizer reload with a real Megatron optimizer (CPU shim or GPU)."""

from __future__ import annotations

import threading

import torch

from tests.engines.megatron import tiny_gpt

GATE_S = 60.0  # bound on a held-back copy's wait (never reached when the test passes)


def _inner_optimizers(trainer) -> list[torch.optim.Optimizer]:
    from refitkit.engines.megatron._internals import leaf_optimizers

    return [leaf.optimizer for leaf in leaf_optimizers(trainer.optimizer)]


def _state(trainer) -> dict[str, torch.Tensor]:
    """Weights, fp32 main params and optimizer state, on the CPU: what bit-identity is checked on."""
    from refitkit.engines import megatron as rm

    adapter_view = rm.MegatronAdapter(trainer.chunks, trainer.optimizer)
    out = {f"w.{n}": t for n, t in tiny_gpt.weights(trainer).items()}
    out.update({f"o.{n}": t.detach().to("cpu", copy=True) for n, t in adapter_view._optimizer_tensors()})
    return out


def deferred_megatron_step(rank: int, world_size: int, use_distributed_optimizer: bool, fail: bool) -> dict:
    """Reference: 4 steps with a plain offload + reload after step 2. Deferred: reload(defer_optimizer=True),
    the copies held back until Megatron's step reaches its inner optimizer (or failing there with ``fail``)."""
    from refitkit.engines import DeviceState
    from refitkit.engines import megatron as rm
    from refitkit.errors import RefitError

    reference = tiny_gpt.build(use_distributed_optimizer=use_distributed_optimizer)
    reference_losses = [tiny_gpt.train_step(reference, s) for s in range(2)]
    plain = rm.MegatronAdapter(reference.chunks, reference.optimizer)
    plain.offload()
    plain.reload()
    reference_losses += [tiny_gpt.train_step(reference, s) for s in range(2, 4)]

    trainer = tiny_gpt.build(use_distributed_optimizer=use_distributed_optimizer)
    losses = [tiny_gpt.train_step(trainer, s) for s in range(2)]
    adapter = rm.MegatronAdapter(trainer.chunks, trainer.optimizer)
    adapter.offload()
    gate = threading.Event()
    victim = adapter._optimizer_tensors()[-1][0]

    def before_copy(name: str) -> None:
        gate.wait(GATE_S)
        if fail and name == victim:
            raise RuntimeError("injected regrow failure")

    adapter._deferred_before_copy = before_copy
    seen: dict = {}
    inner = _inner_optimizers(trainer)

    def at_inner_step(opt, args, kwargs):  # registered before the adapter's hooks: runs first
        if "optimizer_bytes" not in seen:
            seen["optimizer_bytes"] = adapter.state_bytes().optimizer.device_bytes
            gate.set()

    mine = [opt.register_step_pre_hook(at_inner_step) for opt in inner]
    adapter.reload(defer_optimizer=True)
    seen["arriving"] = adapter.part_states.optimizer is DeviceState.ARRIVING
    seen["hooked"] = sum(len(opt._optimizer_step_pre_hooks) for opt in inner) == 2 * len(inner)
    if fail:
        seen["failed_loss"] = tiny_gpt.forward_backward(trainer, 2)
        try:
            tiny_gpt.optimizer_step(trainer, 2)
            seen["error"] = None
        except RefitError as error:
            seen["error"] = str(error)
        seen["after_failure"] = adapter.part_states.optimizer.name
        seen["optimizer_bytes_after_failure"] = adapter.state_bytes().optimizer.device_bytes
        adapter._deferred_before_copy = None
        adapter.reload()  # the plain reload's retry rule
        # the whole step again: Megatron's step had clipped the grads in place before it reached the hook
        losses += [tiny_gpt.train_step(trainer, s) for s in range(2, 4)]
        seen["failed_loss_equal"] = seen["failed_loss"] == losses[2]
    else:
        losses += [tiny_gpt.train_step(trainer, s) for s in range(2, 4)]
    for handle in mine:
        handle.remove()
    seen["on_device"] = adapter.part_states.optimizer is DeviceState.ON_DEVICE
    seen["hooks_left"] = sum(len(opt._optimizer_step_pre_hooks) for opt in inner)
    final, expected = _state(trainer), _state(reference)
    seen["losses_equal"] = losses == reference_losses
    seen["state_equal"] = sorted(final) == sorted(expected) and all(torch.equal(final[k], expected[k]) for k in final)
    seen["victim"] = victim
    return seen
