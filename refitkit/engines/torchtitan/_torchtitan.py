"""The torchtitan objects the TorchTitan adapter reads, in one place (checked against torchtitan 0.3.0)."""

from __future__ import annotations

from typing import Any

import torch

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
