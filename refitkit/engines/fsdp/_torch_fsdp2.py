"""The torch FSDP2 / DTensor calls the FSDP adapter relies on, in one place.

Checked against torch 2.13.0 (``torch.distributed.fsdp.FSDPModule``, ``DTensor.full_tensor``).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


def reshard_all(module: nn.Module) -> None:
    """Reshard every FSDP2 module under ``module``, freeing unsharded params (torch 2.13.0).

    ``FSDPModule.reshard()`` is public but not recursive, hence the walk; a no-op for modules
    that were never ``fully_shard``-ed.
    """
    from torch.distributed.fsdp import FSDPModule

    for submodule in module.modules():
        if isinstance(submodule, FSDPModule):
            submodule.reshard()


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (sharded or replicated over a device mesh)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a DTensor, gathered from every rank of its mesh (a collective)."""
    with torch.no_grad():
        return tensor.full_tensor()


def state_dict_entries(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Params and persistent buffers with their state-dict names, in ``state_dict()`` order (torch 2.13.0).

    Reads ``nn.Module._non_persistent_buffers_set``, the attribute ``state_dict`` itself uses;
    a tensor shared by two modules (tied weights) is listed once, under its first name.
    """
    seen: set[int] = set()
    for prefix, submodule in module.named_modules():
        skip = submodule._non_persistent_buffers_set
        own = [*submodule.named_parameters(recurse=False), *submodule.named_buffers(recurse=False)]
        for name, tensor in own:
            if name in skip or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            yield (f"{prefix}.{name}" if prefix else name), tensor
