"""RefitCycle end to end: a real spawned peer receives bit-identical weights; the trainer's state is freed."""

from __future__ import annotations

import pytest
import torch

from refitkit.demo import build_model, run_demo
from refitkit.report import PhaseRecord


@pytest.mark.timeout(240)
def test_refit_rounds_deliver_identical_weights_and_free_the_trainer():
    result = run_demo(rounds=3)
    assert len(result.rounds) == 3
    for round_ in result.rounds:
        assert round_.peer_matches, "the peer's weights differ from the trainer's"
        assert round_.freed_while_offloaded, "device bytes left after offload"
        names = [phase.name for phase in round_.refit.phases]
        assert names == ["sync_weights", "offload", "flush_device", "barrier"]
        weights = round_.refit.phase("sync_weights").bytes
        offloaded = round_.refit.phase("offload").bytes
        assert weights == sum(p.numel() * 4 for p in build_model(torch.device("cpu")).parameters())
        assert offloaded >= 3 * weights  # params + AdamW exp_avg + exp_avg_sq
        assert round_.resume.phase("reload").bytes == offloaded
    assert result.explicit_gc == 0
    # allocated once: exactly the offloaded bytes plus per-storage alignment
    offloaded = result.rounds[0].refit.phase("offload").bytes
    assert offloaded <= result.arena_bytes <= offloaded + 256 * 64


def test_phase_record_repr_shows_its_rate():
    record = PhaseRecord("offload", start_s=0.25, seconds=0.5, bytes=3_000_000_000)
    assert (
        repr(record) == "PhaseRecord(name='offload', start_s=0.25, seconds=0.5, bytes=3000000000, extra={}, gbps=6.0)"
    )


@pytest.mark.timeout(240)
def test_two_fsdp_ranks_refit_with_one_sender_and_a_real_barrier():
    from tests.helpers.world import run_world
    from tests.refit import ranks

    sender_rank, other_rank = run_world(ranks.refit_two_ranks, 2, timeout_s=180)
    assert sender_rank["phases"] == other_rank["phases"] == ["sync_weights", "offload", "flush_device", "barrier"]
    assert sender_rank["received_equal"], "the receiver's weights differ from the gathered full weights"
    assert sender_rank["sync_bytes"] > 0 and other_rank["sync_bytes"] == 0  # rank 1 only joined the gathers
    assert sender_rank["offloaded"] and other_rank["offloaded"]
    assert sender_rank["loss_finite"] and other_rank["loss_finite"]


def _phases_device_in_the_worker_thread() -> dict:
    """Child process: the caller is on GPU 1; arefit/aresume run their phases in a worker thread."""
    import asyncio

    from refitkit.engines.fsdp import FSDPAdapter
    from refitkit.refit import RefitCycle

    torch.cuda.set_device(1)
    model = torch.nn.Linear(64, 64).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    optimizer.step()
    seen: list[tuple[str, int]] = []
    cycle = RefitCycle(
        FSDPAdapter(model, optimizer), None, on_phase=lambda name: seen.append((name, torch.cuda.current_device()))
    )

    async def cycle_once() -> None:
        await cycle.arefit(1)
        await cycle.aresume(1)

    asyncio.run(cycle_once())
    cycle.close()
    return {"seen": seen, "gpu0_context_bytes": torch.cuda.memory_reserved(0)}


@pytest.mark.cuda
@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs: the caller on GPU 1")
def test_arefit_and_aresume_run_on_the_callers_gpu_not_on_gpu_0():
    from tests.offload.child import run_in_child

    result = run_in_child(_phases_device_in_the_worker_thread)
    assert {device for _, device in result["seen"]} == {1}, result["seen"]
    assert [name for name, _ in result["seen"]][-2:] == ["reload", "barrier"]
    assert result["gpu0_context_bytes"] == 0  # nothing was allocated on GPU 0


@pytest.mark.timeout(120)
def test_the_cycle_passes_on_the_adapters_word_that_its_weights_stay_as_they_are(monkeypatch):
    # An unsharded model's named_weights() are its own tensors (HeldWeights): the cycle's stream says so to the
    # sender, which then batches their small copies (one cat per run) as it does a module's named_parameters().
    import uuid

    from refitkit.engines.fsdp import FSDPAdapter
    from refitkit.refit import RefitCycle
    from refitkit.transfer import BucketedWeightSender
    from tests.transfer.peers import ReceiverServer, digest
    from tests.transfer.test_handoffs import counted_runs

    runs = counted_runs(monkeypatch)
    torch.manual_seed(3)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(6)))
    optimizer = torch.optim.AdamW(model.parameters())
    # (digests of copies: .numpy() makes a storage non-resizable, and the offload would refuse the param)
    expected = {name: digest(tensor.clone()) for name, tensor in model.state_dict().items()}
    endpoint = f"held-{uuid.uuid4().hex[:8]}"
    server = ReceiverServer()
    try:
        with BucketedWeightSender(endpoint, bucket_bytes=16 << 10, transport="shm", timeout_s=30.0) as sender:
            with RefitCycle(FSDPAdapter(model, optimizer), sender) as cycle:
                server.start_session(endpoint, device="cpu", timeout_s=30.0)
                cycle.refit(0)
                result = server.result()
                cycle.resume(0)
    finally:
        server.close()
    assert result["ok"] and result["digests"] == expected, result
    assert sum(runs) == 12 and max(runs) >= 2, runs  # 6 weights + 6 biases, in runs (one by one: runs == [])
