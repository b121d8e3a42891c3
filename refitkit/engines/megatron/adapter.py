"""MegatronAdapter: the EngineAdapter for megatron-core model chunks and their Megatron optimizer."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import torch

from refitkit.engines.base import DeviceState, EngineAdapter, FreshWeights, NamedTensors
from refitkit.engines.megatron import _internals, hf_layouts
from refitkit.engines.megatron._arenas import shared_arena
from refitkit.engines.megatron.main_params import (
    main_pairs,
    main_params_match,
    rebuild_model_params,
    rebuildable_tensors,
)
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
from refitkit.offload import drop_tensors, regrow_tensors

logger = logging.getLogger(__name__)


class MegatronAdapter(EngineAdapter):
    """Offload / reload of Megatron model chunks (DDP or not) and a Megatron optimizer, per part.

    Parts: ``model`` = param buffers, params outside them and module buffers; ``grad`` = the
    DDP grad buffers (dropped and rebuilt zeroed, or kept with ``keep_grads``) and loose
    ``.grad``s; ``optimizer`` = inner state and fp32 master copies. Shares its ``HostArena`` with
    the module-level ``offload_megatron_*`` functions for the same objects, so both can be mixed.

    ``rebuild_params_from_main``: with a mixed-precision optimizer (fp32 main params), offload
    drops the bf16/fp16 model params instead of copying them and reload rebuilds them from the
    main params with Megatron's own cast (see ``main_params``): about 1/7 fewer bytes with Adam.
    Opt-in: it needs the optimizer state back whenever the model is reloaded (not deferred),
    and with the distributed optimizer the reload all-gathers the param buffers (a collective).
    """

    _drops_grads_while_copying = False  # its grad buffers are freed after the phase's synchronize (drop_grads)

    def __init__(
        self,
        model_chunks: torch.nn.Module | Sequence[torch.nn.Module],
        optimizer: object | None = None,
        *,
        keep_grads: bool = False,
        zero_grads: bool = False,
        hf_family: str | None = None,
        rebuild_params_from_main: bool = False,
    ) -> None:
        self.chunks = as_chunks(model_chunks)
        if not isinstance(rebuild_params_from_main, bool):
            raise InvalidInput(
                f"MegatronAdapter: rebuild_params_from_main= must be a bool, got {rebuild_params_from_main!r}"
            )
        if rebuild_params_from_main and any(_internals.overlaps_param_gather(chunk) for chunk in self.chunks):
            raise InvalidInput(
                "MegatronAdapter(rebuild_params_from_main=True) needs overlap_param_gather=False in the DDP config: "
                "with it, the param all-gather of the last step may still be pending at offload"
            )
        self.rebuild_params_from_main = rebuild_params_from_main
        self._dropped: NamedTensors = []  # model tensors dropped on offload, rebuilt from main params on reload
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

    def _model_tensors_to_move(self) -> NamedTensors:
        if not self._dropped:
            return self._model_tensors()
        dropped = {t.untyped_storage()._cdata for _, t in self._dropped}
        return [(n, t) for n, t in self._model_tensors() if t.untyped_storage()._cdata not in dropped]

    def _model_tensors_to_reserve(self) -> NamedTensors:
        # the params rebuilt from the main params need no host bytes (an offload that finds them changed
        # copies them after all, reserving their slots then); the main params may still be arriving: the
        # offload waits for them first, then drops the params
        if not self.rebuild_params_from_main or self._states["optimizer"] is DeviceState.OFFLOADED:
            return self._model_tensors()
        rebuilt = {
            t.untyped_storage()._cdata
            for _, t in rebuildable_tensors(self.chunks, self._leaves, main_pairs(self._leaves))
        }
        return [(n, t) for n, t in self._model_tensors() if t.untyped_storage()._cdata not in rebuilt]

    def _optimizer_tensors(self) -> NamedTensors:
        return copy_param_tensors(self._leaves, self._leaves) + state_tensors(self._leaves, self._leaves)

    def _guarded_modules(self) -> list[torch.nn.Module]:
        return list(self.chunks)

    def _step_optimizers(self) -> list[torch.optim.Optimizer]:
        return step_optimizers(self._leaves)

    def _grad_params(self) -> NamedTensors:
        return loose_grads(self.chunks)

    # --- grads live in DDP grad buffers (and loose .grad of non-DDP chunks) --------------------

    def _prepare_offload(self, parts: list[str]) -> None:
        if "model" in parts and self.rebuild_params_from_main:
            self._dropped = self._params_to_drop()
        if "optimizer" in parts:
            drop_main_grads(self._leaves)  # rebuilt from the grad buffers at the next step

    def _params_to_drop(self) -> NamedTensors:
        """The model params the main params rebuild, if they are on the device and match them now."""
        if self._states["optimizer"] is not DeviceState.ON_DEVICE:
            return []  # the main params are not here to check against: the params travel
        pairs = main_pairs(self._leaves)
        candidates = rebuildable_tensors(self.chunks, self._leaves, pairs)
        if candidates and not main_params_match(self._leaves, pairs):
            logger.warning(
                "MegatronAdapter: the model params differ from the optimizer's main params cast to their dtype "
                "(written outside the optimizer?); offloading them by copy this time"
            )
            return []
        return candidates

    def _after_offload(self, parts: list[str]) -> None:
        if "model" in parts and self._dropped:
            drop_tensors(self._dropped, self.arena)

    def _check_reload(self, *, model: bool, optimizer: bool, defer_optimizer: bool) -> None:
        """With dropped params the optimizer's main params must come back too (not deferred)."""
        if model and self._dropped and self._states["model"] is DeviceState.OFFLOADED:
            main_back = self._states["optimizer"] is DeviceState.ON_DEVICE or optimizer
            if not main_back or (defer_optimizer and self._states["optimizer"] is DeviceState.OFFLOADED):
                raise InvalidInput(
                    "MegatronAdapter.reload(): the model params were dropped on offload (rebuild_params_from_main=True) "
                    "and are rebuilt from the optimizer's main params, so the optimizer must be reloaded with the model, "
                    "not deferred; nothing was restored"
                )

    def _after_reload(self, parts: list[str]) -> None:
        if "model" in parts and self._dropped:
            regrow_tensors(self._dropped, self.arena, zero=False)
            rebuild_model_params(self.chunks, self._leaves)
            self._dropped = []

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
        Each tensor is a new gather, the model's own param (no tensor parallelism) or a view of one
        of those (the Hugging Face splits), never a buffer refilled later: the stream says so
        (``FreshWeights``), so a direct sender may keep each while the engine reads it in place.
        """
        if self._states["model"] is not DeviceState.ON_DEVICE:
            raise InvalidInput("MegatronAdapter.named_weights(): the model is offloaded; reload(model=True) first")
        return FreshWeights(iter_full_weights(self.chunks, hf_family=self.hf_family))
