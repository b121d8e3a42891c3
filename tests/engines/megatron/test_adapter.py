"""MegatronAdapter on a real Megatron GPT in gloo worlds: per-part state machine, kept grads, frozen
params outside the DDP buffers, full weights for inference, and a model without DDP."""

from __future__ import annotations

import pytest
import torch

from tests.engines.megatron import tiny_gpt
from tests.helpers.world import run_world

FROZEN = ("embedding.word_embeddings.weight",)  # outside the DDP buffers, like a LoRA base


def _all_device_bytes(trainer) -> dict[str, int]:
    optimizer = trainer.optimizer
    leaf = optimizer.chained_optimizers[0]
    frozen = [p for p in trainer.chunks[0].parameters() if not p.requires_grad]
    return {
        "params": tiny_gpt.device_bytes([p for p in trainer.chunks[0].parameters() if p.requires_grad]),
        "frozen": tiny_gpt.device_bytes(frozen),
        "grads": tiny_gpt.device_bytes([p.main_grad for p in trainer.chunks[0].parameters() if p.requires_grad]),
        "copies": tiny_gpt.device_bytes([p for g in leaf.shard_fp32_from_float16_groups for p in g]),
        "state": tiny_gpt.device_bytes([v for s in leaf.optimizer.state.values() for k, v in s.items() if k != "step"]),
    }


def adapter_world(rank: int, world_size: int) -> dict:
    from refitkit.engines import megatron as rm
    from refitkit.errors import InvalidInput

    reference = tiny_gpt.build(frozen=FROZEN)
    reference_losses = [tiny_gpt.train_step(reference, step) for step in range(4)]
    reference_weights = tiny_gpt.weights(reference)

    trainer = tiny_gpt.build(frozen=FROZEN)
    losses = [tiny_gpt.train_step(trainer, step) for step in range(2)]
    adapter = rm.MegatronAdapter(trainer.chunks, trainer.optimizer)
    seen: dict = {
        "arena_shared": rm.arena_of(trainer.chunks[0])
        is adapter.arena
        is rm.arena_of(trainer.optimizer.chained_optimizers[0])
    }
    seen["before"] = _all_device_bytes(trainer)
    seen["weights"] = {name: w.to("cpu", copy=True) for name, w in adapter.named_weights()}
    seen["says_fresh"] = getattr(
        adapter.named_weights(), "refitkit_fresh_tensors", False
    )  # gathers, params, their views
    seen["gpt_names"] = [n for n, _ in trainer.chunks[0].module.module.named_parameters()]

    seen["initial_state"] = adapter.state
    move = adapter.offload()
    seen["offloaded"] = _all_device_bytes(trainer)
    seen["states_after_offload"] = (adapter.state, adapter.part_states)
    seen["move"] = (move.total.bytes, move.model.bytes, move.optimizer.bytes, move.grad.bytes)
    seen["second_offload_bytes"] = adapter.offload().total.bytes + adapter.to("cpu").total.bytes
    try:
        next(adapter.named_weights())
        seen["named_weights_offloaded"] = "no error"
    except InvalidInput as error:
        seen["named_weights_offloaded"] = str(error)
    if torch.cuda.is_available():
        adapter.to(trainer.device)
    else:
        try:
            adapter.to("cuda")
            seen["to_cuda_on_cpu"] = "no error"
        except InvalidInput as error:
            seen["to_cuda_on_cpu"] = str(error)
        adapter.reload()
    seen["reloaded"] = _all_device_bytes(trainer)
    seen["state_after_reload"] = adapter.state
    losses.append(tiny_gpt.train_step(trainer, 2))

    # keep grads across an offload between backward and the optimizer step
    losses.append(tiny_gpt.forward_backward(trainer, 3))
    grads = [p.main_grad.detach().to("cpu", copy=True) for p in trainer.chunks[0].parameters() if p.requires_grad]
    adapter.offload(keep_grads=True)
    seen["kept_grads_freed"] = _all_device_bytes(trainer)["grads"]
    adapter.reload()
    seen["kept_grads_restored"] = all(
        torch.equal(p.main_grad.cpu(), g)
        for p, g in zip([p for p in trainer.chunks[0].parameters() if p.requires_grad], grads)
    )
    tiny_gpt.optimizer_step(trainer, 3)
    return {
        "reference_losses": reference_losses,
        "losses": losses,
        "weights_identical": {n: torch.equal(w, reference_weights[n]) for n, w in tiny_gpt.weights(trainer).items()},
        "seen": seen,
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [1, 2])
def test_adapter_offload_reload_keeps_training_bit_identical(world_size):
    from refitkit.engines import DeviceState

    results = run_world(adapter_world, world_size, timeout_s=200)
    for rank, result in enumerate(results):
        seen = result["seen"]
        before = seen["before"]
        assert seen["arena_shared"]
        assert all(before.values()), before
        assert seen["initial_state"] is DeviceState.ON_DEVICE
        assert seen["offloaded"] == {part: 0 for part in before}, "every device storage freed, frozen params too"
        state, parts = seen["states_after_offload"]
        assert state is DeviceState.OFFLOADED
        assert parts.model is parts.optimizer is parts.grad is DeviceState.OFFLOADED
        total, model, optimizer, grad = seen["move"]
        assert model == before["params"] + before["frozen"]
        assert optimizer >= before["copies"] + before["state"]
        assert grad == 0 and total == model + optimizer  # grads dropped, not copied
        assert seen["second_offload_bytes"] == 0
        assert "offloaded" in seen["named_weights_offloaded"]
        if "to_cuda_on_cpu" in seen:
            assert "reload()" in seen["to_cuda_on_cpu"]
        assert seen["reloaded"] == before and seen["state_after_reload"] is DeviceState.ON_DEVICE
        assert seen["kept_grads_freed"] == 0 and seen["kept_grads_restored"]
        assert result["losses"] == result["reference_losses"], rank
        assert all(result["weights_identical"].values())
        # full, unsharded weights named as in GPTModel, one entry per param
        assert list(seen["weights"]) == seen["gpt_names"]
        assert seen["says_fresh"] is True  # a direct sender may keep each while the engine reads it in place
    if world_size == 2:
        # each rank updated only its optimizer shard; the all-gathered weights must agree in full
        w0, w1 = results[0]["seen"]["weights"], results[1]["seen"]["weights"]
        assert all(torch.equal(w0[name], w1[name]) for name in w0)


def no_ddp_world(rank: int, world_size: int) -> dict:
    """A bf16 GPT without DDP or optimizer (e.g. a reference policy) through the model functions."""
    from refitkit.engines import megatron as rm

    model = tiny_gpt.build(ddp=False, with_optimizer=False)
    params = list(model.chunks[0].parameters())
    logits = tiny_gpt.logits(model)
    moved = rm.offload_megatron_model_to_cpu(model.chunks)
    freed = tiny_gpt.device_bytes(params)
    rm.load_megatron_model_to_gpu(model.chunks)
    same = torch.equal(tiny_gpt.logits(model), logits)
    # control: the reload really copies from the host arena (not a lucky reuse of freed memory)
    rm.offload_megatron_model_to_cpu(model.chunks[0])
    arena = rm.arena_of(model.chunks[0])
    for param in params:
        slot = arena.slot_of(param.untyped_storage())
        arena.host_bytes(slot, slot.nbytes).fill_(0)
    rm.load_megatron_model_to_gpu(model.chunks[0])
    return {
        "moved": moved.bytes,
        "bytes": sum(p.numel() * p.element_size() for p in params),
        "freed": freed,
        "same_logits": same,
        "zeroed_through_arena": all(bool((p == 0).all()) for p in params),
    }


@pytest.mark.timeout(120)
def test_model_without_ddp_round_trips_through_the_arena():
    (result,) = run_world(no_ddp_world, 1, timeout_s=100)
    assert result["moved"] == result["bytes"] > 0
    assert result["freed"] == 0
    assert result["same_logits"]
    assert result["zeroed_through_arena"]
