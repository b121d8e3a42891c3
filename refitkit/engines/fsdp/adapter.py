"""FSDPAdapter: offload / reload and full-weight streaming for FSDP2 (``fully_shard``) models."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from refitkit.engines.base import DeviceState, EngineAdapter, NamedTensors
from refitkit.engines.fsdp._torch_fsdp2 import full_tensor, is_dtensor, reshard_all, state_dict_entries
from refitkit.errors import InvalidInput, RefitError
from refitkit.offload import HostArena, optimizer_state_tensors

# wrapper modules that add a path component the checkpoint / inference side does not have
_WRAPPER_COMPONENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod"})


def clean_fqn(name: str) -> str:
    """The parameter name without activation-checkpoint and ``torch.compile`` wrapper components."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_COMPONENTS)


class FSDPAdapter(EngineAdapter):
    """Offload / reload of FSDP2 models (or plain ``nn.Module``s) and their optimizers.

    ``model`` is one module or a list of model parts (pipeline stages); ``optimizer`` one
    optimizer, a list, or None. Sharded params (DTensors), sharded optimizer states and
    buffers move per storage through ``refitkit.offload``; FSDP modules are resharded first so
    no unsharded all-gather buffer is left behind.
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        *,
        arena: HostArena | None = None,
        keep_grads: bool = False,
        zero_grads: bool = False,
    ) -> None:
        super().__init__(arena=arena, keep_grads=keep_grads, zero_grads=zero_grads)
        self.model_parts: list[nn.Module] = _as_modules(model)
        self.optimizers: list[torch.optim.Optimizer] = _as_optimizers(optimizer)

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

        A sharded param is gathered with ``full_tensor()``, a collective: every rank must iterate
        the same weights together. The generator keeps no reference to a yielded tensor, so the
        extra memory at any time is the one full tensor the caller holds.
        """
        if self._states["model"] is DeviceState.OFFLOADED:
            raise RefitError(
                f"{type(self).__name__}.named_weights(): the model is offloaded; reload(model=True) first"
            )
        self._prepare_offload()
        for part in self.model_parts:
            for name, tensor in state_dict_entries(part):
                # no local holds the tensor across the yield: peak extra memory stays one tensor
                yield clean_fqn(name), (full_tensor(tensor) if is_dtensor(tensor) else tensor.detach())


def _as_modules(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    parts = [model] if isinstance(model, nn.Module) else list(model)
    if not parts:
        raise InvalidInput("FSDPAdapter: model is an empty list; pass a module or a non-empty list of model parts")
    for index, part in enumerate(parts):
        if not isinstance(part, nn.Module):
            raise InvalidInput(f"FSDPAdapter: model part {index} is a {type(part).__name__}, not an nn.Module")
    return parts


def _as_optimizers(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    optimizers = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    for index, item in enumerate(optimizers):
        if not isinstance(item, torch.optim.Optimizer):
            raise InvalidInput(f"FSDPAdapter: optimizer {index} is a {type(item).__name__}, not a torch.optim.Optimizer")
    return optimizers
