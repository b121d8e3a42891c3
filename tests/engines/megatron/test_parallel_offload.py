"""Offload -> reload under TP/PP/VPP/EP: two more real pipeline-schedule train steps are bit-identical to a
run without offload, every device storage is freed while offloaded, and named_weights() streams the same
Hugging Face tensors before and after."""

from __future__ import annotations

import pytest
import torch

from tests.engines.megatron import parallel_gpt, tiny_gpt
from tests.engines.megatron.parallel_gpt import Layout
from tests.helpers.world import run_world

pytestmark = pytest.mark.timeout(900)


def offload_world(rank: int, world_size: int, layout: Layout) -> dict:
    from refitkit.engines.megatron import MegatronAdapter

    reference = parallel_gpt.build_trainer(layout)
    reference_losses = [parallel_gpt.train_step(reference, step) for step in range(4)]
    reference_weights = parallel_gpt.weights(reference)

    trainer = parallel_gpt.build_trainer(layout)
    losses = [parallel_gpt.train_step(trainer, step) for step in range(2)]
    adapter = MegatronAdapter(trainer.chunks, trainer.optimizer, hf_family=layout.family)
    streamed_before = [(name, t.to("cpu", copy=True)) for name, t in adapter.named_weights()]
    params = [p for chunk in trainer.chunks for p in chunk.parameters()]
    grads = [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
    moved = adapter.offload()
    freed = tiny_gpt.device_bytes(params) == 0 and tiny_gpt.device_bytes(grads) == 0
    adapter.reload()
    streamed_after = [(name, t.to("cpu", copy=True)) for name, t in adapter.named_weights()]
    losses += [parallel_gpt.train_step(trainer, step) for step in (2, 3)]
    after_two = dict(streamed_before)
    trained = any(not torch.equal(after_two[n], t.cpu()) for n, t in adapter.named_weights())
    return {
        "trained": trained,
        "losses": (reference_losses, losses),
        "weights": (reference_weights, parallel_gpt.weights(trainer)),
        "freed": freed,
        "moved": (moved.model.bytes, moved.optimizer.bytes),
        "streamed": (streamed_before, streamed_after),
    }


LAYOUTS = {
    "tp2": (2, Layout(tp=2)),
    "pp2": (2, Layout(pp=2)),
    "pp2-vpp2": (2, Layout(pp=2, vpp=2, num_layers=8)),
    "ep2-moe": (2, Layout(ep=2, moe=True, family="qwen3_moe", num_layers=2)),
    "pp2-ep2-moe": (4, Layout(pp=2, ep=2, moe=True, family="qwen3_moe", num_layers=4)),
    "tp2-pp2": (4, Layout(tp=2, pp=2)),
}


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_offload_reload_then_train_is_bit_identical(label: str) -> None:
    world_size, layout = LAYOUTS[label]
    for rank, result in enumerate(run_world(offload_world, world_size, layout, timeout_s=600.0)):
        reference_losses, losses = result["losses"]
        assert losses == reference_losses, f"rank {rank}"
        reference_weights, weights = result["weights"]
        assert reference_weights.keys() == weights.keys()
        changed = [n for n in weights if not torch.equal(weights[n], reference_weights[n])]
        assert not changed, f"rank {rank}: {changed}"
        assert result["trained"], f"rank {rank}: steps 2 and 3 changed no weight"
        assert result["freed"], f"rank {rank}: device storage left while offloaded"
        model_bytes, optimizer_bytes = result["moved"]
        assert model_bytes > 0 and optimizer_bytes > 0
        before, after = result["streamed"]
        assert [n for n, _ in before] == [n for n, _ in after]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(before, after))
