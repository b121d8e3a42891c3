"""On a GPU, unshimmed: each function frees / restores device memory, and training stays bit-identical.

Run on the GPU machine: ``python -m pytest -m cuda tests/engines/megatron/test_cuda.py``.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch

from tests.engines.megatron import tiny_gpt
from tests.helpers.world import run_world

pytestmark = pytest.mark.cuda


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cuda_world(rank: int, world_size: int, port: int) -> dict:
    """Reference run and offloaded run on the GPU, over NCCL (the helper's gloo group is swapped out)."""
    from refitkit.engines import megatron as rm

    torch.distributed.destroy_process_group()
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    torch.use_deterministic_algorithms(True, warn_only=True)

    reference = tiny_gpt.build(hidden_size=256, num_layers=2)
    reference_losses = [tiny_gpt.train_step(reference, step) for step in range(4)]
    reference_weights = tiny_gpt.weights(reference)

    trainer = tiny_gpt.build(hidden_size=256, num_layers=2)
    losses = [tiny_gpt.train_step(trainer, step) for step in range(2)]
    calls = [
        ("offload_megatron_model_to_cpu", lambda: rm.offload_megatron_model_to_cpu(trainer.chunks)),
        ("offload_megatron_copy_params", lambda: rm.offload_megatron_copy_params(trainer.optimizer)),
        ("offload_megatron_optimizer", lambda: rm.offload_megatron_optimizer(trainer.optimizer)),
        ("load_megatron_copy_params", lambda: rm.load_megatron_copy_params(trainer.optimizer)),
        ("load_megatron_optimizer", lambda: rm.load_megatron_optimizer(trainer.optimizer)),
        ("load_megatron_model_to_gpu", lambda: rm.load_megatron_model_to_gpu(trainer.chunks)),
    ]
    rows = []
    grad_bytes = sum(b.grad_data.untyped_storage().nbytes() for b in trainer.chunks[0].buffers)
    for name, call in calls:
        before = torch.cuda.memory_allocated()
        stats = call()
        rows.append((name, stats.bytes, before, torch.cuda.memory_allocated()))
    losses += [tiny_gpt.train_step(trainer, step) for step in range(2, 4)]
    pinned = rm.arena_of(trainer.chunks[0]).pinned and rm.arena_of(trainer.optimizer.chained_optimizers[0]).pinned
    return {
        "rows": rows,
        "grad_bytes": grad_bytes,
        "pinned": pinned,
        "losses": losses,
        "reference_losses": reference_losses,
        "weights_identical": all(torch.equal(w, reference_weights[n]) for n, w in tiny_gpt.weights(trainer).items()),
    }


@pytest.mark.timeout(300)
def test_functions_free_and_restore_gpu_memory_and_training_is_bit_identical():
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    (result,) = run_world(cuda_world, 1, _free_port(), timeout_s=280)
    rows = {name: (moved, before, after) for name, moved, before, after in result["rows"]}
    for name, (moved, before, after) in rows.items():
        print(f"{name:32s} moved {moved / 2**20:8.2f} MiB  allocated {before / 2**20:8.2f} -> {after / 2**20:8.2f} MiB")
    assert result["pinned"]
    moved, before, after = rows["offload_megatron_model_to_cpu"]
    assert moved > 0 and before - after >= moved + result["grad_bytes"]
    for name in ("offload_megatron_copy_params", "offload_megatron_optimizer"):
        moved, before, after = rows[name]
        assert moved > 0 and before - after >= moved, name
    for name in ("load_megatron_copy_params", "load_megatron_optimizer"):
        moved, before, after = rows[name]
        assert moved > 0 and after - before >= moved, name
    moved, before, after = rows["load_megatron_model_to_gpu"]
    assert after - before >= moved + result["grad_bytes"]
    assert result["losses"] == result["reference_losses"]
    assert result["weights_identical"]
