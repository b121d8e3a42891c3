"""Weights of every pipeline stage on every rank of a pipeline group, one tensor at a time.

Under pipeline parallelism each rank holds only its stages' layers, but the rank that streams
to the inference engine must send the whole model. Each pipeline rank in turn broadcasts its
own (already gathered and named) weights over the pipeline group: a small header says what
comes (a name, a shape, a dtype; msgpack, nothing executable), then the tensor. The other ranks
of a stage (data / tensor parallel) run the same exchange in their own pipeline groups, so the
gathers inside a stage line up as they do without pipelining.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgpack
from typing import TYPE_CHECKING

import torch

from refitkit.errors import InvalidInput

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# header words: [more (1) or done (0), metadata bytes]
_HEADER_WORDS = 2


def across_stages(
    local: Iterator[tuple[str, torch.Tensor]], group: ProcessGroup, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every pipeline rank's weights, in pipeline-rank order, on every rank of ``group``.

    ``local`` is this rank's own stream (iterated only in its turn); ``device`` is where the
    headers and received tensors live (the model's device: CUDA for NCCL, CPU for gloo).
    A collective over ``group``: every member iterates to the end together.
    """
    import torch.distributed as dist

    me = dist.get_rank(group)
    for owner in range(dist.get_world_size(group)):
        if owner == me:
            for name, tensor in local:
                _send(name, tensor, group, owner, device)
                yield name, tensor
                del tensor
            _broadcast_header(0, 0, group, owner, device)
        else:
            yield from _receive_from(owner, group, device)


def _send(name: str, tensor: torch.Tensor, group: ProcessGroup, owner: int, device: torch.device) -> None:
    import torch.distributed as dist

    if tensor.device != device:
        raise InvalidInput(
            f"pipeline stage stream: {name!r} is on {tensor.device}, the pipeline group exchanges on {device}; "
            "keep every model part on one device"
        )
    meta = msgpack.packb([name, list(tensor.shape), str(tensor.dtype).removeprefix("torch.")])
    _broadcast_header(1, len(meta), group, owner, device)
    dist.broadcast(torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(device), group=group, group_src=owner)
    dist.broadcast(tensor.contiguous(), group=group, group_src=owner)


def _receive_from(owner: int, group: ProcessGroup, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    import torch.distributed as dist

    while True:
        header = torch.zeros(_HEADER_WORDS, dtype=torch.int64, device=device)
        dist.broadcast(header, group=group, group_src=owner)
        more, meta_bytes = header.tolist()
        if not more:
            return
        meta = torch.empty(meta_bytes, dtype=torch.uint8, device=device)
        dist.broadcast(meta, group=group, group_src=owner)
        name, shape, dtype_name = msgpack.unpackb(meta.cpu().numpy().tobytes())
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise InvalidInput(f"pipeline stage stream: pipeline rank {owner} sent {name!r} with unknown dtype {dtype_name!r}")
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, group=group, group_src=owner)
        yield name, tensor
        del tensor


def _broadcast_header(more: int, meta_bytes: int, group: ProcessGroup, owner: int, device: torch.device) -> None:
    import torch.distributed as dist

    dist.broadcast(torch.tensor([more, meta_bytes], dtype=torch.int64, device=device), group=group, group_src=owner)
