"""Whole tensors from DTensors without ``DTensor.full_tensor()``: one all-gather per sharded mesh dim.

``full_tensor()`` runs through DTensor's dispatcher, whose pytree flattening leaves a reference
cycle per call (torch 2.13.0): garbage a GC-free refit must not make. This module gathers the
local shard itself with ``all_gather_into_tensor`` on each mesh dimension's process group.

Covers every layout FSDP2, TorchTitan and Automodel give a parameter: ``Replicate``, ``Shard(d)``
(even or uneven, laid out like ``torch.chunk``: the last ranks may hold fewer or no rows) on any
number of mesh dims, including two mesh dims on one tensor dim in either order (FSDP x TP's
``(_StridedShard(0), Shard(0))`` and plain ``(Shard(0), Shard(0))``). Reads the private
``DTensor._local_tensor`` and ``DTensorSpec.shard_order`` (torch 2.13.0; the order in which the
mesh dims split each tensor dim, which ``_StridedShard`` encodes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from refitkit.errors import InvalidInput

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrder


def gather_full(tensor: torch.Tensor, *, name: str = "") -> torch.Tensor:
    """The whole tensor behind the DTensor ``tensor`` (a collective over its mesh; a plain tensor back).

    Every rank of the mesh must call it for the same tensor. ``name`` only labels errors.
    """
    from torch.distributed.tensor import Replicate

    spec = tensor._spec
    mesh = tensor.device_mesh
    for mesh_dim, placement in enumerate(spec.placements):
        if not (isinstance(placement, Replicate) or hasattr(placement, "dim")):
            raise InvalidInput(
                f"gather_full({name or 'tensor'!r}): placement {placement} on mesh dim {mesh_dim} is neither "
                "Shard nor Replicate (a Partial param is mid-reduction); stream weights after the optimizer step"
            )
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise InvalidInput(f"gather_full({name or 'tensor'!r}): this rank is not part of the tensor's device mesh")
    order = _shard_order(spec, mesh)
    if order is None:
        raise InvalidInput(
            f"gather_full({name or 'tensor'!r}): placements {spec.placements} name no order of splits "
            "(a _StridedShard split factor that no mesh-dim order gives)"
        )
    with torch.no_grad():
        full = tensor._local_tensor
        for entry in order:
            full = _gather_tensor_dim(full, mesh, coordinate, entry.tensor_dim, entry.mesh_dims, tensor.shape)
        return full.detach()


def _shard_order(spec: DTensorSpec, mesh: DeviceMesh) -> ShardOrder | None:
    """Per sharded tensor dim, the mesh dims that split it in the order they did (torch 2.13.0).

    ``DTensorSpec.shard_order`` is left None when ``_StridedShard`` placements encode the order;
    DTensor's own converter reads it from them then.
    """
    if spec.shard_order is not None:
        return spec.shard_order
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    return DTensorSpec._maybe_convert_StridedShard_to_shard_order(spec.placements, mesh)


def _gather_tensor_dim(
    local: torch.Tensor,
    mesh: DeviceMesh,
    coordinate: list[int],
    tensor_dim: int,
    mesh_dims: tuple[int, ...],
    global_shape: torch.Size,
) -> torch.Tensor:
    """Undo the splits of ``tensor_dim`` over ``mesh_dims`` (listed in the order they were applied)."""
    # the size of tensor_dim before each split, as this rank sees it
    sizes = [int(global_shape[tensor_dim])]
    for mesh_dim in mesh_dims[:-1]:
        sizes.append(_chunk_size(sizes[-1], mesh.size(mesh_dim), coordinate[mesh_dim]))
    # the last split is undone first
    for mesh_dim, size in zip(reversed(mesh_dims), reversed(sizes)):
        local = _all_gather_chunks(local, mesh.get_group(mesh_dim), mesh.size(mesh_dim), tensor_dim, size)
    return local


def _chunk_size(size: int, parts: int, index: int) -> int:
    """Length of ``torch.chunk``'s ``index``-th piece of ``size`` into ``parts`` (0 past the last)."""
    step = -(-size // parts)
    return max(0, min(step, size - index * step))


def _all_gather_chunks(local: torch.Tensor, group: ProcessGroup, parts: int, dim: int, size: int) -> torch.Tensor:
    """All-gather ``torch.chunk``-style pieces of ``dim`` (total ``size``) from the ranks of ``group``."""
    import torch.distributed as dist

    step = -(-size // parts)
    # all_gather_into_tensor stacks along dim 0: bring the sharded dim to the front
    front = local.movedim(dim, 0) if dim else local
    padded = front.new_zeros((step, *front.shape[1:]))
    padded[: front.shape[0]].copy_(front)
    gathered = front.new_empty((step * parts, *front.shape[1:]))
    dist.all_gather_into_tensor(gathered, padded, group=group)
    whole = gathered[:size]
    return whole.movedim(0, dim).contiguous() if dim else whole
