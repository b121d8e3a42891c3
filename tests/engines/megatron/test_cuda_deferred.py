"""On GPUs, unshimmed, over NCCL: deferred optimizer reload and rebuild_params_from_main with real Megatron.

Run on the GPU machine: ``python -m pytest -m cuda tests/engines/megatron/test_cuda_deferred.py``.
"""

from __future__ import annotations

import socket

import pytest
import torch

from tests.engines.megatron import deferred_ranks, main_params_ranks
from tests.helpers.world import run_world

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300)]

RANK_FUNCTIONS = {
    "deferred": deferred_ranks.deferred_megatron_step,
    "rebuild": main_params_ranks.rebuild_world,
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def on_nccl(rank: int, world_size: int, port: int, which: str, *args: object) -> dict:
    """The same rank function as the CPU tests, on this rank's GPU over NCCL (the helper's gloo group swapped out)."""
    torch.distributed.destroy_process_group()
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    return RANK_FUNCTIONS[which](rank, world_size, *args)


@pytest.mark.parametrize("use_distributed_optimizer", [True, False], ids=["distributed", "float16"])
def test_megatron_step_on_gpu_waits_for_the_side_stream_and_trains_bit_identical(use_distributed_optimizer):
    (seen,) = run_world(on_nccl, 1, _free_port(), "deferred", use_distributed_optimizer, False, timeout_s=240)
    assert seen["arriving"] and seen["hooked"] and seen["optimizer_bytes"] == 0
    assert seen["on_device"] and seen["hooks_left"] == 0
    assert seen["losses_equal"] and seen["state_equal"]


def test_a_failed_deferred_reload_on_gpu_raises_at_the_megatron_step():
    (seen,) = run_world(on_nccl, 1, _free_port(), "deferred", True, True, timeout_s=240)
    assert repr(seen["victim"]) in seen["error"] and seen["after_failure"] == "OFFLOADED"
    assert seen["losses_equal"] and seen["state_equal"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_rebuild_params_from_main_on_gpu_moves_fewer_bytes_and_stays_bit_identical(world_size):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    for rank, seen in enumerate(run_world(on_nccl, world_size, _free_port(), "rebuild", True, timeout_s=240)):
        assert seen["moved_model_bytes"] == seen["model_bytes"] - seen["bf16_bytes"] and seen["bf16_bytes"] > 0, rank
        assert seen["device_bytes_after_offload"] == 0, rank
        assert seen["streamed_equal"] and seen["losses_equal"] and seen["weights_equal"], rank
        assert seen["moved_model_bytes_when_changed"] == seen["model_bytes"] and seen["changed_kept"], rank
