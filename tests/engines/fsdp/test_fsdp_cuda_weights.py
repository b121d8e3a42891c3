"""FSDPAdapter.named_weights on a GPU over NCCL: the dim-0 gather equals DTensor.full_tensor bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.world import run_world


def gathered_equals_full_tensor(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from refitkit.engines.fsdp import FSDPAdapter
    from tests.helpers.bits import bits_equal

    torch.cuda.set_device(0)
    mesh = DeviceMesh.from_group(dist.new_group(backend="nccl"), "cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(33, 65), nn.GELU(), nn.Linear(65, 7)).cuda()  # odd sizes: uneven shards
    for block in model:
        if isinstance(block, nn.Linear):
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    reference = {name: p.full_tensor().cpu() for name, p in model.named_parameters()}
    weights = {name: t.cpu() for name, t in FSDPAdapter(model).named_weights()}
    return {
        "same_names": sorted(weights) == sorted(reference),
        "equal": all(bits_equal(weights[n], reference[n]) for n in reference),
    }


@pytest.mark.cuda
@pytest.mark.timeout(200)
def test_named_weights_gather_matches_full_tensor_on_nccl():
    (result,) = run_world(gathered_equals_full_tensor, 1, timeout_s=150)
    assert result == {"same_names": True, "equal": True}
