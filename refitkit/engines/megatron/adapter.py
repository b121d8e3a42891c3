"""MegatronAdapter: the EngineAdapter for megatron-core model chunks and their Megatron optimizer."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from refitkit.engines.base import DeviceState, EngineAdapter, NamedTensors
from refitkit.engines.megatron import hf_layouts
from refitkit.engines.megatron._arenas import shared_arena
from refitkit.engines.megatron.model import (
    as_chunks,
    drop_grads,
    grad_buffer_tensors,
    kept_grad_tensors,
    loose_grads,
    model_tensors,
    regrow_grads,
)
from refitkit.engines.megatron.optimizer import (
    copy_param_tensors,
    drop_main_grads,
    leaves,
    state_tensors,
    step_optimizers,
)
from refitkit.engines.megatron.weights import iter_full_weights
from refitkit.errors import InvalidInput


class MegatronAdapter(EngineAdapter):
    """Offload / reload of Megatron model chunks (DDP or not) and a Megatron optimizer, per part.

    Parts: ``model`` = param buffers, params outside them and module buffers; ``grad`` = the
    DDP grad buffers (dropped and rebuilt zeroed, or kept with ``keep_grads``) and loose
    ``.grad``s; ``optimizer`` = inner state and fp32 master copies. Shares its ``HostArena`` with
    the module-level ``offload_megatron_*`` functions for the same objects, so both can be mixed.
    """

    def __init__(
        self,
        model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
        optimizer: object | None = None,
        *,
        keep_grads: bool = False,
        zero_grads: bool = False,
        hf_family: str | None = None,
    ) -> None:
        self.chunks = as_chunks(model_chunks)
        if hf_family is not None:
            hf_layouts.table(hf_family)  # an unknown family fails here, not mid-stream
        self.hf_family = hf_family
        self.optimizer = optimizer
        self._leaves = leaves(optimizer) if optimizer is not None else []
        arena = shared_arena([*self.chunks, *self._leaves])
        super().__init__(arena=arena, keep_grads=keep_grads, zero_grads=zero_grads)

    # --- enumeration -----------------------------------------------------------------------

    def _model_tensors(self) -> NamedTensors:
        return model_tensors(self.chunks)

    def _optimizer_tensors(self) -> NamedTensors:
        return copy_param_tensors(self._leaves, self._leaves) + state_tensors(self._leaves, self._leaves)

    def _step_optimizers(self) -> list[torch.optim.Optimizer]:
        return step_optimizers(self._leaves)

    def _grad_params(self) -> NamedTensors:
        return loose_grads(self.chunks)

    # --- grads live in DDP grad buffers (and loose .grad of non-DDP chunks) --------------------

    def _prepare_offload(self, parts: list[str]) -> None:
        if "optimizer" in parts:
            drop_main_grads(self._leaves)  # rebuilt from the grad buffers at the next step

    def _grads_to_keep(self) -> NamedTensors:
        return grad_buffer_tensors(self.chunks) + [(f"{name}.grad", p.grad) for name, p in loose_grads(self.chunks)]

    def _drop_grads(self) -> None:
        drop_grads(self.chunks, self.arena)

    def _grads_to_restore(self, zero: bool) -> NamedTensors:
        return kept_grad_tensors(self.chunks, self.arena)

    def _after_grad_reload(self, zero: bool) -> None:
        regrow_grads(self.chunks, self.arena, zero_all=zero)  # dropped buffers come back zeroed

    # --- weights for inference -------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights as (name, tensor), one at a time: Hugging Face names with ``hf_family``, else Megatron's.

        Tensor-parallel shards are gathered (a collective: every rank of the model must iterate
        to the end, in step). A rank yields its own pipeline stage's layers (numbered for the whole
        model) and its own experts; see ``refitkit.engines.megatron.weights`` for who streams what.
        """
        if self._states["model"] is not DeviceState.ON_DEVICE:
            raise InvalidInput("MegatronAdapter.named_weights(): the model is offloaded; reload(model=True) first")
        return iter_full_weights(self.chunks, hf_family=self.hf_family)
