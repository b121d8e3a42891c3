"""Early copies and grouped frees on a GPU: steady rounds of hundreds of storages stay bit-exact, every
storage is freed (device memory drops by all of them) and the early copies never outlive a refused move."""

from __future__ import annotations

import pytest
import torch

from refitkit.errors import InvalidInput
from refitkit.offload import HostArena, flush_device, offload_tensors, reload_tensors
from refitkit.offload import moves as moves_module
from refitkit.offload.early import RoundPlan
from tests.offload.test_moves import random_tensor

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(180)]


def _storages(count: int) -> dict[str, torch.Tensor]:
    """Sizes from 4 bytes to ~8 MiB, like a model's norms, steps and matrices; more than a few free groups."""
    sizes = [1 + (i * 7919) % (2 << 20) if i % 3 else 1 for i in range(count)]
    return {f"t{i}": random_tensor((n,), torch.float32, seed=i).cuda() for i, n in enumerate(sizes)}


def test_steady_rounds_with_early_copies_and_grouped_frees_are_exact_and_free_everything():
    tensors = _storages(5 * moves_module.FREE_EVERY_COPIES + 7)
    arena, plan = HostArena(), RoundPlan()
    for round_index in range(3):
        for name, tensor in tensors.items():  # a train step writes new values every round
            tensor.copy_(random_tensor(tuple(tensor.shape), tensor.dtype, seed=1000 * round_index + int(name[1:])))
        expected = {name: t.cpu() for name, t in tensors.items()}
        allocated = torch.cuda.memory_allocated()
        plan.issue_offload(arena)
        offload_tensors(tensors, arena, plan=plan)
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors.values())
        freed = sum(t.numel() * 4 for t in tensors.values())
        assert allocated - torch.cuda.memory_allocated() >= freed, f"round {round_index}: every storage was freed"
        flush_device()
        plan.issue_reload(arena)
        reload_tensors(tensors, arena, plan=plan)
        torch.cuda.synchronize()
        assert all(
            torch.equal(tensors[name].cpu().view(torch.int32), expected[name].view(torch.int32)) for name in tensors
        )


def test_a_reload_refused_after_early_copies_leaves_nothing_regrown_or_queued():
    tensors = _storages(200)
    arena, plan = HostArena(), RoundPlan()
    offload_tensors(tensors, arena, plan=plan)
    reload_tensors(tensors, arena, plan=plan)
    expected = {name: t.cpu() for name, t in tensors.items()}
    offload_tensors(tensors, arena, plan=plan)
    flush_device()
    base = torch.cuda.memory_allocated()
    plan.issue_reload(arena)
    assert torch.cuda.memory_allocated() > base, "regrown early"
    with pytest.raises(InvalidInput, match=r"cannot reload to cpu"):
        reload_tensors(tensors, arena, device="cpu", plan=plan)
    assert torch.cuda.memory_allocated() == base, "what the early copies regrew is freed again"
    reload_tensors(tensors, arena)
    torch.cuda.synchronize()
    assert all(torch.equal(tensors[name].cpu().view(torch.int32), expected[name].view(torch.int32)) for name in tensors)
