"""torchtitan's OptimizersContainer checkpointed right after a deferred reload: state_dict / load_state_dict wait."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan", reason="needs the torchtitan env: make test-torchtitan")

from tests.engines.torchtitan import deferred_checkpoint_ranks  # noqa: E402
from tests.helpers.world import run_world  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_container_state_dict_while_arriving_waits_and_is_bit_identical_to_a_run_without_offload():
    (seen,) = run_world(deferred_checkpoint_ranks.checkpoint_while_arriving, 1, "save", timeout_s=240)
    assert seen["arriving"] and seen["on_device"]  # ARRIVING after the reload, ON_DEVICE after the call: it waited
    assert seen["hooked"] and seen["optimizer_bytes"] == 0  # the container's call reached its inner optimizers first
    assert seen["hooks_left"] == 0
    assert seen["saved_equal"]


@pytest.mark.parametrize("mode", ["load", "dcp_load"], ids=["load_state_dict", "in_place_like_dcp"])
def test_a_checkpoint_loaded_into_the_container_while_arriving_wins_over_the_deferred_copies(mode):
    (seen,) = run_world(deferred_checkpoint_ranks.checkpoint_while_arriving, 1, mode, timeout_s=240)
    assert seen["arriving"] and seen["on_device"]  # ARRIVING after the reload, ON_DEVICE after the call: it waited
    assert seen["hooked"] and seen["optimizer_bytes"] == 0
    assert seen["hooks_left"] == 0
    assert seen["loaded_equal"]  # the state is the checkpoint's, not the offloaded one's
    assert seen["losses_equal"] and seen["state_equal"]
