"""Rank functions for the DTensor gather tests: every layout FSDP2 / TP / FSDP x TP give a param, over gloo."""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers.bits import bits_equal

# odd sizes: 4 ranks leave uneven and empty shards on both dims
SHAPES = [(10, 7), (3, 5), (8, 4), (1, 9)]


def _layouts(world_size: int) -> list[tuple[str, object, tuple]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    flat = init_device_mesh("cpu", (world_size,))
    grid = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    tp = world_size // 2
    return [
        ("Shard(0)", flat, (Shard(0),)),
        ("Shard(1)", flat, (Shard(1),)),
        ("Replicate", flat, (Replicate(),)),
        ("(Shard(0),Shard(0))", grid, (Shard(0), Shard(0))),
        ("(Shard(0),Shard(1))", grid, (Shard(0), Shard(1))),
        ("(Shard(1),Shard(0))", grid, (Shard(1), Shard(0))),
        ("(Replicate,Shard(1))", grid, (Replicate(), Shard(1))),
        ("(Shard(0),Replicate)", grid, (Shard(0), Replicate())),
        ("(_StridedShard(0),Shard(0))", grid, (_StridedShard(0, split_factor=tp), Shard(0))),
    ]


def gather_every_layout(rank: int, world_size: int) -> dict:
    """gather_full against the source tensor for each layout and shape; cyclic garbage of the gathers."""
    from torch.distributed.tensor import distribute_tensor

    from refitkit.engines.fsdp._dtensor_gather import gather_full
    from refitkit.watchdog import CycleAudit

    results: dict = {}
    dtensors = []
    for label, mesh, placements in _layouts(world_size):
        for shape in SHAPES:
            if label.startswith("(_Strided") and shape[0] % world_size:
                continue  # distribute_tensor cannot build an uneven _StridedShard (torch 2.13); FSDP x TP test has one
            source = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) * 0.5 + 1.0
            dtensor = distribute_tensor(source, mesh, placements)
            dtensors.append(dtensor)
            got = gather_full(dtensor, name=label)
            results[f"{label}{shape}"] = (
                type(got).__name__,
                tuple(got.shape) == shape and bits_equal(got, source),
                tuple(dtensor._local_tensor.shape),
            )
    for dtensor in dtensors:  # warm: process groups, allocator
        gather_full(dtensor)
    with CycleAudit() as audit:
        for dtensor in dtensors:
            gather_full(dtensor)
    results["cyclic"] = (audit.report.cyclic_objects, dict(audit.report.by_type))
    with CycleAudit() as audit:
        for dtensor in dtensors:
            dtensor.full_tensor()
    results["cyclic_full_tensor"] = audit.report.cyclic_objects
    results["partial_error"] = _partial_error(_layouts(world_size)[0][1])
    return results


def _partial_error(mesh) -> str:
    """gather_full of a Partial DTensor (mid-reduction, not a weight): the error it raises."""
    from torch.distributed.tensor import DTensor, Partial

    from refitkit.engines.fsdp._dtensor_gather import gather_full
    from refitkit.errors import InvalidInput

    partial = DTensor.from_local(torch.ones(2, 3), mesh, [Partial()])
    try:
        gather_full(partial, name="layers.0.w")
    except InvalidInput as error:
        return str(error)
    return "no error"


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 6, bias=False)
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(torch.relu(self.up(x))))


def fsdp_tp_named_weights(rank: int, world_size: int) -> dict:
    """FSDPAdapter.named_weights() of a real FSDP2 x TP model (2-D mesh) against the unsharded weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from refitkit.engines.fsdp import FSDPAdapter
    from refitkit.watchdog import CycleAudit

    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    reference = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    grid = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
    for block in model:
        parallelize_module(block, grid["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=grid["dp"])
    fully_shard(model, mesh=grid["dp"])
    placements = {name: str(param.placements) for name, param in model.named_parameters()}
    adapter = FSDPAdapter(model)
    weights = [(name, tensor.clone()) for name, tensor in adapter.named_weights()]
    list(adapter.named_weights())  # warm
    with CycleAudit() as audit:
        for _ in adapter.named_weights():
            pass
    return {
        "placements": placements,
        "names": [name for name, _ in weights],
        "reference_names": list(reference),
        "equal": {name: bits_equal(tensor, reference[name]) for name, tensor in weights},
        "cyclic": (audit.report.cyclic_objects, dict(audit.report.by_type)),
    }
