"""RefitCycle end to end: a real spawned peer receives bit-identical weights; the trainer's state is freed."""

from __future__ import annotations

import pytest

import torch

from refitkit.demo import build_model, run_demo


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
