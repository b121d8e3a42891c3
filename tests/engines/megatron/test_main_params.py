"""rebuild_params_from_main: the bf16 model params do not travel; reload rebuilds them bit-identically."""

from __future__ import annotations

import pytest

from tests.engines.megatron import main_params_ranks
from tests.helpers.world import run_world

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(
    "world_size,use_distributed_optimizer",
    [(1, True), (1, False), (2, True)],
    ids=["distributed", "float16", "distributed-dp2"],
)
def test_offload_skips_the_bf16_params_and_reload_rebuilds_them_bit_identically(world_size, use_distributed_optimizer):
    for rank, seen in enumerate(
        run_world(main_params_ranks.rebuild_world, world_size, use_distributed_optimizer, timeout_s=240)
    ):
        assert seen["dropped_names"] and seen["bf16_dtypes"] == ["torch.bfloat16"], rank
        assert seen["bf16_bytes"] > 0
        # the model part moved everything but the bf16 params, which left the device without a copy
        assert seen["moved_model_bytes"] == seen["model_bytes"] - seen["bf16_bytes"], rank
        assert seen["device_bytes_after_offload"] == 0 and seen["arena_held"] == seen["moved_total"], rank
        assert "rebuilt from the optimizer's main params" in seen["refused_optimizer"], rank
        assert "not deferred" in seen["refused_defer_optimizer"] and seen["still_offloaded"], rank
        assert seen["streamed_equal"], rank  # the weights streamed after reload equal those before
        assert seen["losses_equal"] and seen["weights_equal"], rank  # 2 more steps as if never offloaded
        assert seen["moved_model_bytes_when_changed"] == seen["model_bytes"], rank  # copied, not dropped
        assert seen["changed_kept"], rank


@pytest.mark.parametrize("drop_first", [True, False], ids=["hook-raises-after-drop", "hook-raises-before-drop"])
def test_a_raising_offload_hook_leaves_the_parts_offloaded_and_reload_restores_them(drop_first):
    (seen,) = run_world(main_params_ranks.hook_failure_world, 1, drop_first, timeout_s=240)
    assert seen["error"] == "injected failure in _after_offload"
    # the copies freed every storage before the hook ran: ON_DEVICE with 0 bytes would make reload skip them
    assert seen["parts"] == ["OFFLOADED"] * 3
    assert seen["parts_after_reload"] == ["ON_DEVICE"] * 3
    assert seen["device_bytes_after_reload"] > 0 and seen["model_bytes_after_reload"] > 0
    assert seen["streamed_equal"] and seen["optimizer_equal"]


@pytest.mark.parametrize("arriving", [False, True], ids=["on-device", "optimizer-arriving"])
def test_prepare_reserves_host_bytes_only_for_what_the_offload_copies(arriving):
    (seen,) = run_world(main_params_ranks.prepare_world, 1, arriving, timeout_s=240)
    assert seen["state_at_prepare"] == ("ARRIVING" if arriving else "ON_DEVICE")
    assert seen["bf16_bytes"] > 0
    # the offload allocated nothing more, and the reservation held no room for the params it drops
    assert seen["arena_after_offload"] == seen["reserved"]
    assert 0 <= seen["reserved"] - seen["moved"] < 256 * seen["storages"]  # slot alignment only
    assert seen["streamed_equal"]
