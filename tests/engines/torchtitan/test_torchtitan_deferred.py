"""Deferred optimizer reload through torchtitan's OptimizersContainer: its inner optimizers' steps wait."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan", reason="needs the torchtitan env: make test-torchtitan")

from tests.engines.torchtitan import deferred_ranks  # noqa: E402
from tests.helpers.world import run_world  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_container_step_waits_for_the_deferred_state_and_trains_bit_identical():
    (seen,) = run_world(deferred_ranks.deferred_through_the_container, 1, timeout_s=240)
    assert seen["arriving"]
    assert seen["optimizer_bytes"] == 0  # the container's step began before any copy ran
    assert seen["on_device"] and seen["hooks_left"] == 0
    assert seen["losses_equal"] and seen["state_equal"]
