"""TorchTitanAdapter: offload / reload for torchtitan's model parts and OptimizersContainer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from refitkit.engines.fsdp.adapter import FSDPAdapter
from refitkit.engines.torchtitan._torchtitan import container_optimizers, require_torchtitan
from refitkit.offload import HostArena


class TorchTitanAdapter(FSDPAdapter):
    """Offload / reload of a torchtitan trainer's state: ``trainer.model_parts`` and ``trainer.optimizers``.

    torchtitan parallelizes with FSDP2 (DTensor params), so moving is the FSDP adapter's; this
    class only unpacks the ``OptimizersContainer`` into the optimizers that hold state. Weight
    names from ``named_weights()`` are torchtitan's own FQNs (wrapper components removed), not
    Hugging Face names: map them with torchtitan's state-dict adapter if the receiver needs that.
    """

    def __init__(
        self,
        model_parts: nn.Module | Sequence[nn.Module],
        optimizers: Any = None,
        *,
        arena: HostArena | None = None,
        keep_grads: bool = False,
        zero_grads: bool = False,
    ) -> None:
        require_torchtitan()
        super().__init__(
            model_parts,
            container_optimizers(optimizers),
            arena=arena,
            keep_grads=keep_grads,
            zero_grads=zero_grads,
        )
