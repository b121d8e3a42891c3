"""The torch FSDP2 / DTensor calls the FSDP adapter relies on, in one place.

Checked against torch 2.13.0 (``torch.distributed.fsdp.FSDPModule``, DTensor gathers in ``_dtensor_gather``,
``DTensor._local_tensor``); the gather also ran on torch 2.11 on the GPU machine.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from refitkit.engines.fsdp._dtensor_gather import gather_full


def reshard_all(module: nn.Module) -> None:
    """Reshard every FSDP2 module under ``module``, freeing unsharded params (torch 2.13.0).

    ``FSDPModule.reshard()`` is public but not recursive, hence the walk; a no-op for modules
    that were never ``fully_shard``-ed.
    """
    from torch.distributed.fsdp import FSDPModule

    for submodule in module.modules():
        if isinstance(submodule, FSDPModule):
            submodule.reshard()


def sharded_params(module: nn.Module) -> list[torch.Tensor] | None:
    """The sharded params FSDP2 keeps for every ``fully_shard``-ed module under ``module`` (torch 2.13.0).

    While a module is unsharded its ``named_parameters()`` show the unsharded params, but the
    optimizer holds the sharded ones (``FSDPParam.sharded_param``). Reads the private
    ``FSDPState._fsdp_param_groups`` (or ``_fsdp_param_group`` on older torch); None when
    those internals are not there, so callers skip what they cannot check.
    """
    from torch.distributed.fsdp import FSDPModule

    found: list[torch.Tensor] = []
    for submodule in module.modules():
        if not isinstance(submodule, FSDPModule):
            continue
        state = submodule._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            params = getattr(group, "fsdp_params", None)
            if params is None:
                return None
            found.extend(param.sharded_param for param in params)
    return found


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (sharded or replicated over a device mesh)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def full_tensor(tensor: torch.Tensor, *, name: str = "") -> torch.Tensor:
    """The whole tensor behind a DTensor, gathered from every rank of its mesh (a collective).

    Goes through ``gather_full`` for every layout (never ``DTensor.full_tensor()``, whose dispatch
    leaves a reference cycle per call on torch 2.13.0).
    """
    return gather_full(tensor, name=name)


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
