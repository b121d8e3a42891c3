"""FSDP2 (gloo, world sizes 1 and 2): RefitCycle.resume(defer_optimizer=True) keeps training bit-identical."""

from __future__ import annotations

import pytest

from tests.engines.fsdp import deferred_ranks
from tests.helpers.world import run_world

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_with_deferred_optimizer_trains_bit_identical_to_the_serial_cycle(world_size):
    for rank, result in enumerate(run_world(deferred_ranks.deferred_resume_matches_serial, world_size, timeout_s=200)):
        assert result["arriving_after_resume"], rank
        assert result["optimizer_device_bytes_at_step"] == 0, rank  # the first step started before any copy
        assert result["on_device_after_step"] and result["hooks_left"] == 0, rank
        assert result["reload_bytes"] == result["model_bytes"], rank  # resume returned with the params only
        assert result["losses_equal"] and result["state_equal"], rank
