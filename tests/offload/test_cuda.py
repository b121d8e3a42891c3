"""Offload core on a GPU: device memory really drops and returns, pinned exact-size arena."""

from __future__ import annotations

import pytest
import torch

from refitkit.errors import InvalidInput
from refitkit.offload import HostArena, flush_device, offload_optimizer, offload_tensors, reload_optimizer, reload_tensors
from tests.offload.test_moves import random_tensor, storage_bytes

pytestmark = pytest.mark.cuda


def test_memory_allocated_drops_by_the_offloaded_bytes_and_comes_back():
    # >10 MiB each: the caching allocator gives each its own segment, so empty_cache can return it
    tensors = {f"w{i}": torch.randn(4096, 2048 + 64 * i, device="cuda", dtype=torch.bfloat16) for i in range(4)}
    expected = {k: v.cpu() for k, v in tensors.items()}
    nbytes = sum(t.untyped_storage().nbytes() for t in tensors.values())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    arena = HostArena()
    moved = offload_tensors(tensors, arena)
    assert moved.bytes == nbytes
    offloaded = torch.cuda.memory_allocated()
    # blocks are rounded up by the caching allocator, so the drop is at least the storage bytes
    assert nbytes <= before - offloaded <= nbytes + len(tensors) * (2 << 20)
    reserved = torch.cuda.memory_reserved()
    flush_device()
    assert torch.cuda.memory_reserved() <= reserved - nbytes + (2 << 20)
    reload_tensors(tensors, arena, device="cuda")
    assert torch.cuda.memory_allocated() == before
    for name, t in tensors.items():
        assert torch.equal(t.cpu(), expected[name]), name


def test_arena_is_pinned_and_exact():
    tensors = [torch.zeros((1 << 20) + 1, dtype=torch.uint8, device="cuda") for _ in range(3)]
    arena = HostArena()
    assert arena.pinned
    offload_tensors(tensors, arena)
    assert all(chunk.is_pinned() for chunk in arena._chunks)
    assert arena.nbytes <= 1.02 * 3 * ((1 << 20) + 1)
    reload_tensors(tensors, arena)
    arena.release()
    assert arena.nbytes == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.bool, torch.complex64, torch.int64])
def test_gpu_round_trip_is_bit_exact(dtype):
    t = random_tensor((33, 7), dtype, seed=5).cuda()
    view = t[3:, ::2]
    before = storage_bytes(t.cpu())
    arena = HostArena()
    offload_tensors({"t": t, "view": view}, arena)
    assert t.untyped_storage().nbytes() == 0
    reload_tensors({"view": view}, arena)
    assert storage_bytes(t.cpu()) == before


def test_mixed_cpu_and_cuda_tensors_are_refused():
    with pytest.raises(InvalidInput, match=r"mixed devices: 'a' is on cuda:0 but 'b' is on cpu"):
        offload_tensors({"a": torch.ones(2, device="cuda"), "b": torch.ones(2)}, HostArena())


def test_adam_state_offload_frees_device_memory():
    model = torch.nn.Linear(512, 512).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    model(torch.randn(4, 512, device="cuda")).sum().backward()
    optimizer.step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    arena = HostArena()
    moved = offload_optimizer(optimizer, arena)
    assert moved.bytes >= 2 * (512 * 512 + 512) * 4
    big_states = 2 * (512 * 512 + 512) * 4  # exp_avg + exp_avg_sq; the 4-byte step scalars sit in 512-byte blocks
    assert before - torch.cuda.memory_allocated() >= big_states
    assert all(t.untyped_storage().nbytes() == 0 for state in optimizer.state.values() for t in state.values())
    reload_optimizer(optimizer, arena)
    assert torch.cuda.memory_allocated() == before
