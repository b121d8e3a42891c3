"""The torchtitan objects the TorchTitan adapter reads, in one place (checked against torchtitan 0.3.0)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from refitkit.errors import InvalidInput


def require_torchtitan() -> None:
    """Import torchtitan or say which extra installs it."""
    try:
        import torchtitan  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "refitkit.engines.torchtitan needs torchtitan: pip install 'refitkit[torchtitan]' "
            "(torchtitan 0.3.0 also imports triton: pip install triton)"
        ) from error


def container_optimizers(optimizers: Any) -> list[torch.optim.Optimizer]:
    """The real optimizers behind a torchtitan ``OptimizersContainer`` (torchtitan 0.3.0).

    The container is itself an ``Optimizer`` whose own ``state`` stays empty; the state lives in
    ``container.optimizers`` (one or more per model part). A plain optimizer or a list passes
    through.
    """
    if optimizers is None:
        return []
    from torchtitan.components.optimizer import OptimizersContainer

    if isinstance(optimizers, OptimizersContainer):
        return list(optimizers.optimizers)
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    if isinstance(optimizers, (list, tuple)):
        return [item for entry in optimizers for item in container_optimizers(entry)]
    raise InvalidInput(
        f"TorchTitanAdapter: optimizers is a {type(optimizers).__name__}; pass torchtitan's "
        "OptimizersContainer, a torch.optim.Optimizer, a list of them, or None"
    )


def check_state_dict_adapter(adapter: Any) -> Any:
    """torchtitan's ``BaseStateDictAdapter`` instance (the trainer's ``checkpointer.sd_adapter``), or None."""
    if adapter is None:
        return None
    from torchtitan.protocols.state_dict_adapter import BaseStateDictAdapter

    if not isinstance(adapter, BaseStateDictAdapter):
        raise InvalidInput(
            f"TorchTitanAdapter: state_dict_adapter is a {type(adapter).__name__}; pass torchtitan's "
            "StateDictAdapter instance, e.g. model_spec.state_dict_adapter(model_config, None), or None for "
            "torchtitan's own names"
        )
    return adapter


def modules_with_save_hooks(part: nn.Module) -> dict[str, nn.Module]:
    """Module prefix -> module, for every module that rewrites its state dict on save (torch 2.13.0).

    torchtitan 0.3.0's ``FusedQKVLinear`` splits its fused ``wqkv`` into ``wq``/``wk``/``wv``
    in such a hook; its ``to_hf`` expects that split layout. Reads ``nn.Module._state_dict_hooks``,
    the dict ``Module.state_dict`` itself runs.
    """
    return {prefix: module for prefix, module in part.named_modules() if module._state_dict_hooks}


def run_save_hooks(module: nn.Module, entries: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Apply ``module``'s state-dict save hooks to ``entries`` (its subtree's full tensors) as ``state_dict`` would.

    Checked against torch 2.13.0's ``Module.state_dict``: a hook gets (module, state_dict, prefix,
    local_metadata); one registered through the private API may return a replacement dict.
    """
    metadata = {"version": getattr(module, "_version", 1)}
    for hook in module._state_dict_hooks.values():
        result = hook(module, entries, prefix, metadata)
        if result is not None and not getattr(hook, "_from_public_api", False):
            entries = result
    return entries
