"""Constructor arguments every engine adapter shares: model parts and optimizers, checked with clear errors."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from refitkit.errors import InvalidInput


def as_modules(value: object, *, owner: str, what: str = "model") -> list[nn.Module]:
    """One module or a non-empty list of them, or an InvalidInput that says what was passed instead."""
    if isinstance(value, nn.Module):
        return [value]
    if isinstance(value, torch.optim.Optimizer):
        raise InvalidInput(
            f"{owner}: {what} is a {type(value).__name__} optimizer, not an nn.Module; the model comes first: "
            f"{owner}({what}, optimizer)"
        )
    parts = _as_list(value, owner=owner, what=what, expected="an nn.Module or a list of nn.Modules")
    if not parts:
        raise InvalidInput(f"{owner}: {what} is an empty list; pass a module or a non-empty list of model parts")
    for index, part in enumerate(parts):
        if not isinstance(part, nn.Module):
            hint = "; the optimizers go in the second argument" if isinstance(part, torch.optim.Optimizer) else ""
            raise InvalidInput(f"{owner}: {what} part {index} is a {type(part).__name__}, not an nn.Module{hint}")
    return parts


def as_optimizers(value: object, *, owner: str, what: str = "optimizer") -> list[torch.optim.Optimizer]:
    """None, one optimizer or a list of them, or an InvalidInput that says what was passed instead."""
    if value is None:
        return []
    if isinstance(value, torch.optim.Optimizer):
        return [value]
    if isinstance(value, nn.Module):
        raise InvalidInput(
            f"{owner}: {what} is a {type(value).__name__} module, not a torch.optim.Optimizer; the model comes "
            f"first: {owner}(model, {what})"
        )
    optimizers = _as_list(value, owner=owner, what=what, expected="a torch.optim.Optimizer, a list of them, or None")
    for index, item in enumerate(optimizers):
        if not isinstance(item, torch.optim.Optimizer):
            raise InvalidInput(f"{owner}: {what} {index} is a {type(item).__name__}, not a torch.optim.Optimizer")
    return optimizers


def check_optimizers_own_params(
    params: Iterable[torch.Tensor], optimizers: list[torch.optim.Optimizer], *, owner: str
) -> None:
    """Every optimized param must be one of ``params`` (the model's), or its state would move without it.

    Catches an optimizer built on another model, or on the module before it was sharded (FSDP2
    and friends register new parameter objects).
    """
    owned = {id(param) for param in params}
    for opt_index, optimizer in enumerate(optimizers):
        for group_index, group in enumerate(optimizer.param_groups):
            for param_index, param in enumerate(group["params"]):
                if id(param) not in owned:
                    raise InvalidInput(
                        f"{owner}: optimizer {opt_index} param_groups[{group_index}].params[{param_index}] (shape "
                        f"{tuple(param.shape)}) is not a parameter of the model passed; build the optimizer on "
                        "this model's parameters (after sharding it), and pass the model first"
                    )


def _as_list(value: object, *, owner: str, what: str, expected: str) -> list:
    # a str or a dict iterates, but as characters or keys: never what the caller meant
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise InvalidInput(f"{owner}: {what} must be {expected}, got a {type(value).__name__}")
    return list(value)
