"""AutomodelAdapter on a tiny HF Llama parallelized by real NeMo Automodel (FSDP2 over gloo)."""

from __future__ import annotations

import pytest

from tests.engines.automodel import ranks
from tests.helpers.world import run_world

CASES = [
    pytest.param(1, False, True, False, id="ws1-unsharded-to-cpu"),
    pytest.param(2, False, False, False, id="ws2-fsdp2-fp32-drop-grads"),
    pytest.param(2, True, True, True, id="ws2-fsdp2-bf16-keep-grads"),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size, mixed_precision, use_to, keep_grads", CASES)
def test_cycle_frees_everything_and_training_is_bit_identical(world_size, mixed_precision, use_to, keep_grads):
    results = run_world(ranks.train_with_cycle, world_size, mixed_precision, use_to, keep_grads, timeout_s=200)
    for rank, result in enumerate(results):
        offloaded = result["offloaded"]
        assert offloaded["sharded"] == (world_size > 1), "Automodel shards with FSDP2 only above one rank"
        assert offloaded["state"] == "OFFLOADED"
        assert offloaded["live_storages"] == [], f"rank {rank}: storages left on the device"
        assert offloaded["grads_left"] == [] and offloaded["device_bytes"] == 0
        assert offloaded["host_bytes"] == offloaded["moved_bytes"] > 0
        assert offloaded["model_bytes"] > 0 and offloaded["optimizer_bytes"] > 0
        assert result["n_grads_before"] > 0, "the scenario must offload with grads present"
        if keep_grads:
            assert offloaded["grad_bytes"] > 0 and not offloaded["grads_none"]
            assert result["grads_changed"] == []
        else:
            assert offloaded["grad_bytes"] == 0 and offloaded["grads_none"]
        assert result["again_bytes"] == 0, "a second to('cpu') must move nothing"
        assert result["state_after_reload"] == "ON_DEVICE" and result["same_objects"]
        assert result["n_state"] > 0 and result["intact"] == [], f"rank {rank}: state changed across the cycle"
        assert result["losses"] == result["base_losses"], f"rank {rank}: losses differ"
        assert result["n_final"] > 0 and result["final_differs"] == [], f"rank {rank}: final state differs"
    if world_size == 2:
        assert results[0]["losses"] != results[1]["losses"], "ranks must see different data"


@pytest.fixture(scope="module")
def two_rank_checks() -> list[dict]:
    # one two-rank world serves the three tests below: spawning ranks costs more than the checks
    return run_world(ranks.two_rank_checks, 2, 3, timeout_s=200)


@pytest.mark.timeout(240)
def test_named_weights_match_the_unsharded_state_dict_bit_for_bit(two_rank_checks):
    for result in two_rank_checks:
        assert result["sharded"]
        assert result["wrapped_module_names"], "Automodel's activation-checkpoint wrappers must be in the tree"
        assert sorted(result["streamed_names"]) == result["full_names"] == result["hf_names"]
        assert len(set(result["streamed_names"])) == len(result["streamed_names"])
        assert result["mismatch"] == []
        assert result["types"] == ["Tensor"], "full tensors, not DTensors"


@pytest.mark.timeout(240)
def test_repeated_cycles_allocate_no_new_host_memory(two_rank_checks):
    for result in two_rank_checks:
        sizes = result["sizes"]
        assert len(sizes) == 3 and all(size == sizes[0] for size in sizes), sizes
        arena_bytes, chunks, held_bytes, storages = sizes[0]
        assert chunks == 1 and held_bytes > 0
        # exact sizing: at most the 256-byte alignment of each storage on top of the bytes held
        assert held_bytes <= arena_bytes <= held_bytes + 256 * storages, (arena_bytes, held_bytes, storages)
        assert result["held_after"] == 0


@pytest.mark.timeout(240)
def test_automodels_ddp_strategy_is_refused_by_name(two_rank_checks):
    for result in two_rank_checks:
        message = result["ddp_refusal"]
        assert "model_parts[0] is a DistributedDataParallel" in message
        assert "strategy ddp" in message and "use the fsdp2 strategy" in message


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_gpu_offload_frees_device_memory_and_training_is_bit_identical():
    from tests.engines.automodel import cuda_ranks

    (result,) = run_world(cuda_ranks.cuda_cycle, 1, timeout_s=280)
    moved, storages = result["moved_bytes"], result["storages"]
    print(
        f"\nautomodel ws1 GPU: moved {moved / 2**20:.1f} MiB in {storages} storages; "
        f"offload {result['offload_gbps']:.1f} GB/s, reload {result['reload_gbps']:.1f} GB/s; "
        f"flat pinned D2H {result['pinned_d2h_gbps']:.1f}, H2D {result['pinned_h2d_gbps']:.1f} GB/s; "
        f"allocated -{result['allocated_drop'] / 2**20:.1f} MiB, reserved -{result['reserved_drop'] / 2**20:.1f} MiB"
    )
    assert result["pinned"]
    # the caching allocator rounds blocks up (512 B small, up to 2 MiB for large segments)
    assert moved <= result["allocated_drop"] <= moved + (2 << 20) * storages
    assert result["reserved_drop"] >= 0.9 * moved, "flush_device must hand the freed blocks back"
    assert result["losses"] == result["base_losses"]
    assert result["final_differs"] == []
