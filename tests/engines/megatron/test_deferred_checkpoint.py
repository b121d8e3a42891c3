"""Megatron's optimizer checkpointed right after a deferred reload: its sharded_state_dict / load_state_dict
wait for the state through the inner torch optimizers' state-dict pre-hooks."""

from __future__ import annotations

import pytest

from tests.engines.megatron import deferred_checkpoint_ranks
from tests.helpers.world import run_world

pytestmark = pytest.mark.timeout(300)

KINDS = pytest.mark.parametrize("use_distributed_optimizer", [True, False], ids=["distributed", "float16"])


@KINDS
def test_sharded_state_dict_while_arriving_waits_and_is_bit_identical_to_a_run_without_offload(
    use_distributed_optimizer,
):
    (seen,) = run_world(
        deferred_checkpoint_ranks.checkpoint_while_arriving, 1, use_distributed_optimizer, "save", timeout_s=240
    )
    assert seen["arriving"] and seen["on_device"]  # ARRIVING after the reload, ON_DEVICE after the call: it waited
    assert seen["hooked"] and seen["optimizer_bytes"] == 0  # Megatron's call reached the inner optimizer first
    assert seen["hooks_left"] == 0
    assert seen["saved_equal"]


@KINDS
def test_a_checkpoint_loaded_while_arriving_wins_over_the_deferred_copies(use_distributed_optimizer):
    (seen,) = run_world(
        deferred_checkpoint_ranks.checkpoint_while_arriving, 1, use_distributed_optimizer, "load", timeout_s=240
    )
    assert seen["arriving"] and seen["on_device"]  # ARRIVING after the reload, ON_DEVICE after the call: it waited
    assert seen["hooked"] and seen["optimizer_bytes"] == 0
    assert seen["hooks_left"] == 0
    assert seen["loaded_equal"]  # the state is the checkpoint's, not the offloaded one's
    assert seen["losses_equal"] and seen["state_equal"]


def test_a_failed_deferred_reload_makes_megatrons_save_raise_naming_the_tensor():
    (seen,) = run_world(deferred_checkpoint_ranks.checkpoint_while_arriving, 1, True, "fail", timeout_s=240)
    assert seen["error"] is not None and repr(seen["victim"]) in seen["error"]
    assert "injected regrow failure" in seen["error"] and "call reload() again" in seen["error"]
    assert seen["after_failure"] == "OFFLOADED" and seen["optimizer_bytes_after_failure"] == 0
    assert seen["on_device"] and seen["hooks_left"] == 0
    assert seen["saved_equal"]  # after the retry, the save has every byte
