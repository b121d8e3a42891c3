"""FSDPAdapter: offload / reload and full-weight streaming for FSDP2 (``fully_shard``) models."""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from refitkit.engines.base import (
    DeviceState,
    EngineAdapter,
    FreshWeights,
    HeldWeights,
    NamedTensors,
    as_modules,
    as_optimizers,
    check_optimizers_own_params,
)
from refitkit.engines.fsdp._pipeline_stages import PipelineStages, across_stages
from refitkit.engines.fsdp._torch_fsdp2 import (
    full_tensor,
    is_dtensor,
    reshard_all,
    sharded_params,
    state_dict_entries,
)
from refitkit.errors import InvalidInput, RefitError
from refitkit.offload import HostArena, optimizer_state_tensors

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from refitkit.engines.fsdp._transformers import CheckpointLayout

logger = logging.getLogger(__name__)

# wrapper modules that add a path component the checkpoint / inference side does not have
_WRAPPER_COMPONENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod"})


def clean_fqn(name: str) -> str:
    """The parameter name without activation-checkpoint and ``torch.compile`` wrapper components."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_COMPONENTS)


class FSDPAdapter(EngineAdapter):
    """Offload / reload of FSDP2 models (or plain ``nn.Module``s) and their optimizers.

    ``model`` is one module or a list of model parts (pipeline stages); ``optimizer`` one
    optimizer, a list, or None; ``pp_group``, the pipeline-parallel process group when the
    parts are this rank's pipeline stages (see ``named_weights``), and ``pp_timeout_s`` how long
    a rank waits for another pipeline rank's next weight before it gives up. Sharded params (DTensors), sharded optimizer states and
    buffers move per storage through ``refitkit.offload``; FSDP modules are resharded first so
    no unsharded all-gather buffer is left behind. ``checkpoint_names``: a transformers model part
    streams under the names and layouts its ``save_pretrained()`` writes (transformers' own conversion
    mapping: fused Mixture-of-Experts weights split per expert); False streams the in-memory names.
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        *,
        arena: HostArena | None = None,
        keep_grads: bool = False,
        zero_grads: bool = False,
        pp_group: ProcessGroup | None = None,
        pp_timeout_s: float = 300.0,
        checkpoint_names: bool = True,
    ) -> None:
        owner = type(self).__name__
        if not isinstance(checkpoint_names, bool):
            raise InvalidInput(f"{owner}: checkpoint_names= must be a bool, got {checkpoint_names!r}")
        self.pp_group = pp_group
        self._stages = PipelineStages(pp_group, timeout_s=pp_timeout_s) if pp_group is not None else None
        self.model_parts: list[nn.Module] = as_modules(model, owner=owner)
        self.optimizers: list[torch.optim.Optimizer] = as_optimizers(optimizer, owner=owner)
        if self.optimizers:
            _check_ownership(self.model_parts, self.optimizers, owner)
        self._layouts = [_checkpoint_layout(part) if checkpoint_names else None for part in self.model_parts]
        super().__init__(arena=arena, keep_grads=keep_grads, zero_grads=zero_grads)

    # --- enumeration -----------------------------------------------------------------------

    def _prepare_offload(self, parts: list[str] | None = None) -> None:
        # an unsharded module holds all-gathered copies that offloading the shards would miss
        for part in self.model_parts:
            reshard_all(part)

    def _model_tensors(self) -> NamedTensors:
        named: NamedTensors = []
        seen: set[int] = set()
        for prefix, part in self._prefixed_parts():
            for name, tensor in [*part.named_parameters(), *part.named_buffers()]:
                if id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                named.append((f"{prefix}{name}", tensor))
        return named

    def _optimizer_tensors(self) -> NamedTensors:
        named: NamedTensors = []
        for index, optimizer in enumerate(self.optimizers):
            prefix = "optimizer." if len(self.optimizers) == 1 else f"optimizers[{index}]."
            named.extend((f"{prefix}{name}", tensor) for name, tensor in optimizer_state_tensors(optimizer))
        return named

    def _guarded_modules(self) -> list[nn.Module]:
        return list(self.model_parts)

    def _step_optimizers(self) -> list[torch.optim.Optimizer]:
        # torchtitan's OptimizersContainer steps (and saves and loads) each of these: hooking them covers the container too
        return list(self.optimizers)

    def _grad_params(self) -> NamedTensors:
        named: NamedTensors = []
        seen: set[int] = set()
        for prefix, part in self._prefixed_parts():
            for name, param in part.named_parameters():
                if param.requires_grad and id(param) not in seen:
                    seen.add(id(param))
                    named.append((f"{prefix}{name}", param))
        return named

    def _prefixed_parts(self) -> list[tuple[str, nn.Module]]:
        if len(self.model_parts) == 1:
            return [("model.", self.model_parts[0])]
        return [(f"model_parts[{index}].", part) for index, part in enumerate(self.model_parts)]

    # --- streaming -------------------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights and persistent buffers as (state-dict name, tensor), one at a time.

        A sharded param is gathered (``gather_full``: one all-gather per sharded mesh dim), a
        collective: every rank must iterate the same weights together. The generator keeps no
        reference to a yielded tensor, so the extra memory at any time is the one full tensor
        the caller holds. A transformers model's weights come under its checkpoint's names and
        layouts (``checkpoint_names``): a fused expert tensor is gathered once and yielded as one
        view per expert and projection, so it stays alive until the caller dropped its last view. With ``pp_group``, every rank of the pipeline group gets every stage's
        weights (stage by stage, in pipeline-rank order), so one rank can send the whole model; a
        stage that fails part-way (or does not come within ``pp_timeout_s``) makes every pipeline
        rank raise. A model with nothing sharded and no pipeline yields its own tensors: the stream
        says so (``HeldWeights``), so a sender may read them where they lie. Without a pipeline the
        gathered tensors are new ones nothing else holds (``FreshWeights``): a sender may keep each
        while the engine reads it in place.
        """
        weights = self._named_weights()
        if self._yields_own_tensors():
            return HeldWeights(weights)
        return FreshWeights(weights) if self._yields_fresh_tensors() else weights

    def _yields_fresh_tensors(self) -> bool:
        """Whether each tensor ``named_weights()`` yields is new (gathered) or the model's own: not with a pipeline,
        whose other stages' weights arrive through staging this class does not vouch for."""
        return self._stages is None

    def _yields_own_tensors(self) -> bool:
        """Whether ``named_weights()`` yields the model's own tensors (no gather, no other pipeline stage's)."""
        if self._stages is not None:
            return False
        if any(layout is not None and not layout.makes_views for layout in self._layouts):
            return False  # a conversion that makes new tensors
        return not any(is_dtensor(tensor) for part in self.model_parts for _, tensor in state_dict_entries(part))

    def _named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._states["model"] is DeviceState.OFFLOADED:
            raise RefitError(f"{type(self).__name__}.named_weights(): the model is offloaded; reload(model=True) first")
        self._prepare_offload()
        if self._stages is None:
            yield from self._local_weights()
        else:
            yield from across_stages(self._local_weights(), self._stages, self.device)

    def _local_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's model parts' full weights (the stream of one pipeline rank), under the checkpoint's names."""
        for part, layout in zip(self.model_parts, self._layouts, strict=True):
            if layout is None:
                yield from self._full_entries(part)
            else:
                entries = [(clean_fqn(name), tensor) for name, tensor in state_dict_entries(part)]
                yield from layout.stream(entries, _whole)

    def _full_entries(self, part: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """One model part's full weights and persistent buffers, (clean FQN, whole tensor), one at a time.

        The caller checked the model is on the device and resharded it (``named_weights``).
        """
        for name, tensor in state_dict_entries(part):
            # no local holds the tensor across the yield: peak extra memory stays one tensor
            yield clean_fqn(name), _whole(name, tensor)


def _whole(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a state-dict entry: gathered when sharded (a collective), else itself, detached."""
    return full_tensor(tensor, name=name) if is_dtensor(tensor) else tensor.detach()


def _checkpoint_layout(part: nn.Module) -> CheckpointLayout | None:
    """A transformers model part's checkpoint layout, or None. Only a transformers model has one, and it exists only
    once transformers was imported: refitkit never imports transformers itself."""
    if "transformers" not in sys.modules:
        return None
    from refitkit.engines.fsdp._transformers import checkpoint_layout

    return checkpoint_layout(part)


def _check_ownership(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], owner: str) -> None:
    # an unsharded FSDP2 module shows its unsharded params; the optimizer holds the sharded ones
    sharded = [sharded_params(part) for part in parts]
    if any(found is None for found in sharded):
        logger.debug("%s: FSDP2 internals not found; optimizer ownership not checked", owner)
        return
    params = itertools.chain((p for part in parts for p in part.parameters()), *sharded)
    check_optimizers_own_params(params, optimizers, owner=owner)
