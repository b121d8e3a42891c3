"""Deferred optimizer reload with Megatron's optimizer: its step waits in the inner torch optimizer's pre-hook."""

from __future__ import annotations

import pytest

from tests.engines.megatron import deferred_ranks
from tests.helpers.world import run_world

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("use_distributed_optimizer", [True, False], ids=["distributed", "float16"])
def test_megatron_step_waits_for_deferred_state_and_trains_bit_identical(use_distributed_optimizer):
    (seen,) = run_world(deferred_ranks.deferred_megatron_step, 1, use_distributed_optimizer, False, timeout_s=240)
    assert seen["arriving"] and seen["hooked"]
    assert seen["optimizer_bytes"] == 0  # Megatron's step reached the inner optimizer before any copy
    assert seen["on_device"] and seen["hooks_left"] == 0
    assert seen["losses_equal"] and seen["state_equal"]


def test_a_failed_deferred_reload_raises_at_the_megatron_step_and_the_retry_is_exact():
    (seen,) = run_world(deferred_ranks.deferred_megatron_step, 1, True, True, timeout_s=240)
    assert seen["error"] is not None and repr(seen["victim"]) in seen["error"]
    assert "injected regrow failure" in seen["error"] and "call reload() again" in seen["error"]
    assert seen["after_failure"] == "OFFLOADED" and seen["optimizer_bytes_after_failure"] == 0
    assert seen["failed_loss_equal"]  # the failed attempt's forward saw the same (restored) params
    assert seen["on_device"] and seen["hooks_left"] == 0
    assert seen["losses_equal"] and seen["state_equal"]
