"""AutomodelAdapter: offload / reload and weight streaming for NeMo Automodel's FSDP2 trainers."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from refitkit.engines.automodel import _nemo_automodel as automodel
from refitkit.engines.fsdp.adapter import FSDPAdapter
from refitkit.errors import InvalidInput
from refitkit.offload import HostArena

logger = logging.getLogger(__name__)


class AutomodelAdapter(FSDPAdapter):
    """Offload / reload of an Automodel recipe's ``model_parts`` and optimizers (fsdp2 strategy).

    Automodel parallelizes Hugging Face models with FSDP2 (or leaves them unsharded on one
    rank), so the moving is the FSDP adapter's; this layer accepts Automodel's shapes of the
    trainer state (a part list or an ``AutoPipeline``, a list of optimizers) and streams weights
    under Hugging Face names through the model's own ``state_dict_adapter`` when it has one (a
    transformers class without one streams what its ``save_pretrained()`` writes, see ``FSDPAdapter``).
    ``hf_names=False`` streams the model's native names instead. ``pp_group`` (the pipeline
    process group when the parts are pipeline stages) makes every stage's weights reach every
    rank of the group; each rank converts what it receives.
    """

    def __init__(
        self,
        model_parts: list[nn.Module] | nn.Module | Any,
        optimizers: list[torch.optim.Optimizer] | torch.optim.Optimizer | None = None,
        *,
        arena: HostArena | None = None,
        keep_grads: bool = False,
        zero_grads: bool = False,
        hf_names: bool = True,
        pp_group: Any = None,
        pp_timeout_s: float = 300.0,
    ) -> None:
        automodel.require_automodel()
        parts = automodel.resolve_model_parts(model_parts)
        optimizer_list = automodel.resolve_optimizers(optimizers)
        _check_optimizers_own_parts(parts, optimizer_list)
        to_hf = automodel.hf_converter(parts) if hf_names else None
        super().__init__(
            parts,
            optimizer_list,
            arena=arena,
            keep_grads=keep_grads,
            zero_grads=zero_grads,
            pp_group=pp_group,
            pp_timeout_s=pp_timeout_s,
            # a transformers class without Automodel's adapter: the names and layouts its save_pretrained() writes
            checkpoint_names=hf_names and to_hf is None,
        )
        self._to_hf = to_hf
        if hf_names and self._to_hf is None:
            logger.info(
                "AutomodelAdapter: %s has no state_dict_adapter; named_weights() yields its own FQNs "
                "(for a transformers class, the names and layouts its save_pretrained() writes)",
                type(parts[0]).__name__,
            )

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights as (Hugging Face name, tensor), one native tensor's worth at a time.

        A collective for sharded models: every rank must iterate together. One native tensor
        may become several HF tensors (e.g. fused experts); only those are held at once.
        """
        native = super().named_weights()
        if self._to_hf is None:
            yield from native
            return
        for name, tensor in native:
            converted = self._to_hf(name, tensor)
            del tensor
            # pop as we go: the generator keeps no reference to what the caller already has
            converted.reverse()
            while converted:
                yield converted.pop()


def _check_optimizers_own_parts(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
    """Every optimized param must be one of the parts' params, or its state would be moved without it."""
    owned = {id(param) for part in parts for param in part.parameters()}
    for opt_index, optimizer in enumerate(optimizers):
        for group_index, group in enumerate(optimizer.param_groups):
            for param_index, param in enumerate(group["params"]):
                if id(param) not in owned:
                    shape = tuple(param.shape)
                    raise InvalidInput(
                        f"AutomodelAdapter: optimizers[{opt_index}].param_groups[{group_index}].params[{param_index}] "
                        f"(shape {shape}) is not a parameter of model_parts; build the optimizer on the "
                        "parallelized model parts (after parallelize_model), not on the original module"
                    )
