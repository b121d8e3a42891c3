"""The one place refitkit touches NeMo Automodel's own objects (checked against nemo-automodel 0.7.0).

Everything else in the Automodel adapter sees plain ``nn.Module``s, FSDP2 DTensors and
``torch.optim`` optimizers, which the FSDP machinery already handles.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from refitkit.errors import InvalidInput

INSTALL_HINT = "install the extra: pip install 'refitkit[automodel]' (nemo-automodel>=0.7)"

# Megatron-FSDP keeps params in its own flat buffers, outside named_parameters' storages
_MEGATRON_FSDP_MODULE_PREFIXES = ("megatron_fsdp", "megatron.core.distributed.fsdp")


class HFConverter(Protocol):
    """Automodel's ``StateDictAdapter.convert_single_tensor_to_hf`` as refitkit calls it."""

    def __call__(self, fqn: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]: ...


def require_automodel() -> None:
    """Import nemo_automodel's checkpoint API, or fail with the extra to install.

    Checked against nemo-automodel 0.7.0 (``nemo_automodel.components.checkpoint.state_dict_adapter``).
    """
    try:
        import nemo_automodel.components.checkpoint.state_dict_adapter  # noqa: F401
    except ImportError as error:
        raise ImportError(f"AutomodelAdapter needs NeMo Automodel ({error}); {INSTALL_HINT}") from error


def resolve_model_parts(model_parts: Any) -> list[nn.Module]:
    """The trainer's model parts: a module, a list of modules, or an ``AutoPipeline``.

    Checked against nemo-automodel 0.7.0: its recipes keep ``model_parts = [model]`` without
    pipelining and ``model_parts = auto_pipeline.parts`` (one module per local stage) with it.
    """
    from nemo_automodel.components.distributed.pipelining import AutoPipeline

    if isinstance(model_parts, AutoPipeline):
        try:
            parts: list[Any] = list(model_parts.parts)
        except RuntimeError as error:  # raised by AutoPipeline.parts before build()
            raise InvalidInput(f"AutomodelAdapter: the AutoPipeline has no stages yet ({error})") from None
    elif isinstance(model_parts, nn.Module):
        parts = [model_parts]
    elif isinstance(model_parts, Sequence) and not isinstance(model_parts, (str, bytes)):
        parts = list(model_parts)
    else:
        raise InvalidInput(
            f"AutomodelAdapter: model_parts is a {type(model_parts).__name__}; pass the recipe's "
            "model_parts (a list of nn.Module), one nn.Module, or an AutoPipeline"
        )
    if not parts:
        raise InvalidInput("AutomodelAdapter: model_parts is empty; pass the recipe's model_parts")
    for index, part in enumerate(parts):
        if not isinstance(part, nn.Module):
            raise InvalidInput(f"AutomodelAdapter: model_parts[{index}] is a {type(part).__name__}, not an nn.Module")
        _reject_unsupported_strategy(index, part)
    return parts


def _reject_unsupported_strategy(index: int, part: nn.Module) -> None:
    """Refuse parts whose training state lives outside the module's own param storages.

    Checked against nemo-automodel 0.7.0: its ``megatron_fsdp`` strategy wraps the model in
    MegatronFSDP (package megatron-fsdp 0.5.0, flat param buffers) and its ``ddp`` strategy in
    torch's ``DistributedDataParallel``, whose reducer keeps gradient buckets on the device.
    """
    from torch.nn.parallel import DistributedDataParallel

    module_name = type(part).__module__
    if isinstance(part, DistributedDataParallel):
        strategy = "ddp (its reducer keeps gradient buckets on the device that offload cannot free)"
    elif module_name.startswith(_MEGATRON_FSDP_MODULE_PREFIXES):
        strategy = "megatron_fsdp (params live in its flat buffers)"
    else:
        return
    raise InvalidInput(
        f"AutomodelAdapter: model_parts[{index}] is a {type(part).__name__} from {module_name}, i.e. distributed "
        f"strategy {strategy}; use the fsdp2 strategy (the default)"
    )


def resolve_optimizers(optimizers: Any) -> list[torch.optim.Optimizer]:
    """The trainer's optimizers: None, one optimizer, or the recipe's list (one per model part).

    Checked against nemo-automodel 0.7.0, whose ``OptimizerConfig.build`` returns a list of
    ``torch.optim.Optimizer`` for the fsdp2 strategy.
    """
    if optimizers is None:
        return []
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    if not isinstance(optimizers, Sequence) or isinstance(optimizers, (str, bytes)):
        raise InvalidInput(
            f"AutomodelAdapter: optimizers is a {type(optimizers).__name__}; pass the recipe's optimizer "
            "list, one torch.optim.Optimizer, or None"
        )
    for index, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidInput(
                f"AutomodelAdapter: optimizers[{index}] is a {type(optimizer).__name__}, not a torch.optim.Optimizer"
            )
    return list(optimizers)


def hf_converter(parts: Sequence[nn.Module]) -> HFConverter | None:
    """The model's native-to-Hugging-Face name converter, or None when its names already are HF's.

    Checked against nemo-automodel 0.7.0: Automodel's own model classes (MoE, fused layouts)
    carry ``state_dict_adapter``, a ``StateDictAdapter`` whose ``convert_single_tensor_to_hf``
    turns one native tensor into its HF tensors; HF classes run as-is and have none.
    Pipeline stages of one model share one adapter type, so the first stage's serves all.
    """
    from nemo_automodel.components.checkpoint.state_dict_adapter import StateDictAdapter

    for part in parts:
        adapter = _find_state_dict_adapter(part)
        if adapter is None:
            continue
        if not isinstance(adapter, StateDictAdapter):
            raise InvalidInput(
                f"AutomodelAdapter: {type(part).__name__}.state_dict_adapter is a {type(adapter).__name__}, "
                "not a nemo_automodel StateDictAdapter; pass hf_names=False to stream native names"
            )
        convert: Callable[..., list[tuple[str, torch.Tensor]]] = adapter.convert_single_tensor_to_hf
        return lambda fqn, tensor: list(convert(fqn, tensor))
    return None


def _find_state_dict_adapter(part: nn.Module) -> Any:
    # FSDP2 swaps the class in place, so the attribute stays on the module (or its wrapped one)
    for module in (part, getattr(part, "module", None), getattr(part, "_orig_mod", None)):
        adapter = getattr(module, "state_dict_adapter", None) if module is not None else None
        if adapter is not None:
            return adapter
    return None
