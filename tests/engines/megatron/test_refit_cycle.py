"""The whole RefitCycle on Megatron at TP2 and PP2 (gloo, CPU shim; unshimmed on the GPU machine): each
stream-source rank sends its Hugging Face-named weights to its own receiver process, every rank offloads
(all device storage freed), lines up, resumes, and trains on bit-identical to a run that never refit."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch

from tests.engines.megatron import parallel_gpt, tiny_gpt
from tests.engines.megatron.parallel_gpt import Layout
from tests.helpers.world import child_env, run_world

pytestmark = pytest.mark.timeout(900)

ROUNDS = 2
TIMEOUT_S = 120.0


def cycle_world(rank: int, world_size: int, layout: Layout, directory: str) -> dict:
    from refitkit.engines.megatron import MegatronAdapter, is_stream_source
    from refitkit.refit import RefitCycle
    from refitkit.transfer import BucketedWeightSender

    reference = parallel_gpt.build_trainer(layout)
    reference_losses = [parallel_gpt.train_step(reference, step) for step in range(ROUNDS + 1)]
    reference_weights = parallel_gpt.weights(reference)

    trainer = parallel_gpt.build_trainer(layout)
    adapter = MegatronAdapter(trainer.chunks, trainer.optimizer, hf_family=layout.family)
    params = [p for chunk in trainer.chunks for p in chunk.parameters()]
    device = tiny_gpt.device()
    sender = receiver = None
    out_path = os.path.join(directory, f"received-{rank}.pt")
    if is_stream_source():
        endpoint = f"megatron-cycle-{os.getpid()}"
        sender = BucketedWeightSender(endpoint, bucket_bytes=1 << 20, timeout_s=TIMEOUT_S)
        receiver = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.engines.megatron.stream_receiver",
                endpoint,
                out_path,
                str(TIMEOUT_S),
                str(ROUNDS),
                device.type,
            ],
            env=child_env(),
        )
    losses, freed, expected = [], [], {}
    try:
        with RefitCycle(adapter, sender, barrier_timeout_s=TIMEOUT_S) as cycle:
            for step in range(ROUNDS):
                losses.append(parallel_gpt.train_step(trainer, step))
                expected = {name: t.to("cpu", copy=True) for name, t in adapter.named_weights()}
                report = cycle.refit(step)
                freed.append(tiny_gpt.device_bytes(params) == 0)
                cycle.resume(step)
            losses.append(parallel_gpt.train_step(trainer, ROUNDS))
    finally:
        if sender is not None:
            sender.close()
        receiver_rc = receiver.wait(timeout=TIMEOUT_S) if receiver is not None else None
    received = torch.load(out_path, weights_only=True)["weights"] if receiver is not None else {}
    return {
        "source": is_stream_source(),
        "receiver_rc": receiver_rc,
        "phases": [p.name for p in report.phases],
        "synced": report.phases[0].bytes,
        "expected": expected if receiver is not None else {},
        "received": received,
        "freed": freed,
        "losses": (reference_losses, losses),
        "identical": all(torch.equal(w, reference_weights[n]) for n, w in parallel_gpt.weights(trainer).items()),
    }


LAYOUTS = {"tp2": Layout(tp=2), "pp2": Layout(pp=2)}


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_refit_cycle_streams_hf_names_offloads_and_trains_on_bit_identical(label: str) -> None:
    layout = LAYOUTS[label]
    with tempfile.TemporaryDirectory(prefix="refitkit-megatron-cycle-") as directory:
        results = run_world(cycle_world, 2, layout, directory, timeout_s=800.0)
    sources = [r for r in results if r["source"]]
    assert len(sources) == (1 if label == "tp2" else 2)  # TP: rank 0 of the TP group; PP: one per stage
    names: list[str] = []
    for result in sources:
        assert result["receiver_rc"] == 0
        assert result["received"].keys() == result["expected"].keys()
        assert all(torch.equal(result["received"][n], t) for n, t in result["expected"].items()), (
            "a streamed weight differs"
        )
        assert result["synced"] == sum(t.numel() * t.element_size() for t in result["expected"].values())
        names += result["received"]
    assert len(names) == len(set(names)), "a weight was streamed by two ranks"
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.norm.weight" in names
    for result in results:
        assert result["phases"] == ["sync_weights", "offload", "flush_device", "barrier"]
        assert result["freed"] == [True] * ROUNDS
        reference_losses, losses = result["losses"]
        assert losses == reference_losses
        assert result["identical"]
