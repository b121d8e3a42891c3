"""The one place refitkit reads megatron-core's private attributes.

Every function here was checked against megatron-core 0.16.1 (newest for Python 3.11) and
0.19.2 (Python 3.12): the attributes it reads have the same names and meaning in both.
Everything else in ``refitkit.engines.megatron`` goes through these functions.
"""

from __future__ import annotations

from typing import Any

import torch

from refitkit.errors import InvalidInput

INSTALL_HINT = "megatron-core is not installed: pip install 'refitkit[megatron]'"


def _megatron() -> Any:
    """megatron.core, imported lazily so ``import refitkit`` needs torch alone."""
    try:
        import megatron.core  # noqa: F401
        from megatron.core import distributed, optimizer
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(INSTALL_HINT) from error
    return distributed, optimizer


def is_ddp(chunk: torch.nn.Module) -> bool:
    """Whether a model chunk is Megatron's ``DistributedDataParallel`` (checked: 0.16.1, 0.19.2)."""
    distributed, _ = _megatron()
    return isinstance(chunk, distributed.DistributedDataParallel)


def check_model_chunk(chunk: object, label: str) -> torch.nn.Module:
    """Reject what these functions cannot enumerate, before anything moves (checked: 0.16.1, 0.19.2)."""
    if not isinstance(chunk, torch.nn.Module):
        raise InvalidInput(f"{label} is a {type(chunk).__name__}, not a torch.nn.Module (a Megatron model chunk)")
    distributed, _ = _megatron()
    fsdp = getattr(distributed, "FullyShardedDataParallel", None)
    if fsdp is not None and isinstance(chunk, fsdp):
        raise InvalidInput(
            f"{label} is Megatron-FSDP ({type(chunk).__name__}); refitkit.engines.megatron supports "
            "megatron DistributedDataParallel and unwrapped modules"
        )
    return chunk


def ddp_buffers(chunk: torch.nn.Module) -> list[tuple[str, Any]]:
    """A DDP chunk's param-and-grad buffers, dense then expert-parallel, labelled (checked: 0.16.1, 0.19.2).

    ``DistributedDataParallel.buffers`` (an attribute that shadows ``Module.buffers()``) and
    ``.expert_parallel_buffers`` are lists of ``_ParamAndGradBuffer``.
    """
    if not is_ddp(chunk):
        return []
    dense = [(f"buffers[{i}]", b) for i, b in enumerate(chunk.buffers)]
    expert = [(f"expert_parallel_buffers[{i}]", b) for i, b in enumerate(chunk.expert_parallel_buffers)]
    return dense + expert


def buffer_param_data(buffer: Any) -> torch.Tensor | None:
    """The flat tensor the buffer's params view, or None when params keep their own storage.

    ``_ParamAndGradBuffer.param_data`` is allocated only with the distributed optimizer
    (checked: 0.16.1, 0.19.2).
    """
    return buffer.param_data


def buffer_grad_data(buffer: Any) -> torch.Tensor | None:
    """The flat tensor every ``param.main_grad`` views (``_ParamAndGradBuffer.grad_data``; checked: 0.16.1, 0.19.2)."""
    return buffer.grad_data


def unwrap_model(chunk: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP and Float16Module wrappers (their ``.module``; checked: 0.16.1, 0.19.2)."""
    distributed, _ = _megatron()
    from megatron.core.transformer.module import Float16Module

    while isinstance(chunk, (distributed.DistributedDataParallel, Float16Module)):
        chunk = chunk.module
    return chunk


def leaf_optimizers(optimizer: object) -> list[Any]:
    """The Megatron optimizers doing the work: a ``ChainedOptimizer``'s ``chained_optimizers``, flattened.

    Checked: 0.16.1, 0.19.2 (where ``LayerWiseDistributedOptimizer`` is a ``ChainedOptimizer``).
    """
    _, optim = _megatron()
    if isinstance(optimizer, optim.ChainedOptimizer):
        leaves: list[Any] = []
        for inner in optimizer.chained_optimizers:
            leaves.extend(leaf_optimizers(inner))
        return leaves
    if not isinstance(optimizer, optim.MegatronOptimizer):
        raise InvalidInput(
            f"expected a Megatron optimizer (megatron.core.optimizer.MegatronOptimizer), got "
            f"{type(optimizer).__name__}; for a plain torch optimizer use refitkit.offload.offload_optimizer"
        )
    return [optimizer]


def copy_param_groups(leaf: Any) -> list[list[torch.Tensor | None]]:
    """The fp32 master copies a mixed-precision optimizer keeps next to the bf16/fp16 params.

    ``DistributedOptimizer.shard_fp32_from_float16_groups`` (this rank's shards; None entries with
    a precision-aware optimizer), ``Float16OptimizerWithFloat16Params.fp32_from_float16_groups``,
    none for ``FP32Optimizer``. Checked: 0.16.1, 0.19.2.
    """
    _, optim = _megatron()
    if getattr(leaf, "is_stub_optimizer", False):
        return []
    if isinstance(leaf, optim.DistributedOptimizer):
        return leaf.shard_fp32_from_float16_groups
    if isinstance(leaf, optim.Float16OptimizerWithFloat16Params):
        return leaf.fp32_from_float16_groups
    if isinstance(leaf, optim.FP32Optimizer):
        return []
    raise InvalidInput(
        f"optimizer kind {type(leaf).__name__} is not supported yet by refitkit.engines.megatron "
        "(supported: DistributedOptimizer, Float16OptimizerWithFloat16Params, FP32Optimizer, and "
        "ChainedOptimizer of those)"
    )


def inner_optimizer(leaf: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer holding the state (``MegatronOptimizer.optimizer``; checked: 0.16.1, 0.19.2).

    None for a stub optimizer (a rank with no params in it).
    """
    copy_param_groups(leaf)  # rejects unsupported kinds first
    inner = leaf.optimizer
    if inner is None or getattr(leaf, "is_stub_optimizer", False):
        return None
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    if isinstance(inner, HybridDeviceOptimizer):
        raise InvalidInput(
            "optimizer kind HybridDeviceOptimizer (optimizer_cpu_offload) is not supported: it already "
            "keeps its state on the host; turn off optimizer_cpu_offload to offload with refitkit"
        )
    if not isinstance(inner, torch.optim.Optimizer):
        raise InvalidInput(
            f"the inner optimizer of {type(leaf).__name__} is a {type(inner).__name__}, not a torch optimizer"
        )
    return inner


def layer_numbers(model: torch.nn.Module) -> list[int]:
    """Global, 0-based layer numbers of a GPT model chunk's ``decoder.layers``, in order.

    ``TransformerLayer.layer_number`` is 1-based and already offset by the pipeline stage and the
    virtual-pipeline chunk (checked: 0.16.1, 0.19.2).
    """
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        return []
    return [int(layer.layer_number) - 1 for layer in decoder.layers]


def expert_numbers(model: torch.nn.Module) -> dict[int, list[int]]:
    """Per local layer index with an MoE block: the global expert number of each local expert.

    ``MoELayer.local_expert_indices`` (this expert-parallel rank's slice; checked: 0.16.1, 0.19.2).
    """
    decoder = getattr(model, "decoder", None)
    if decoder is None:
        return {}
    found = {}
    for index, layer in enumerate(decoder.layers):
        indices = getattr(layer.mlp, "local_expert_indices", None)
        if indices is not None:
            found[index] = [int(e) for e in indices]
    return found


def is_tied_output_copy(model: torch.nn.Module, name: str) -> bool:
    """Whether ``name`` is the last pipeline stage's copy of a tied embedding (not a weight of its own).

    ``GPTModel.share_embeddings_and_output_weights`` with the embedding on another stage
    (``pre_process`` False); checked: 0.16.1, 0.19.2.
    """
    return (
        name == "output_layer.weight"
        and bool(getattr(model, "share_embeddings_and_output_weights", False))
        and not bool(getattr(model, "pre_process", True))
    )


def tensor_parallel_group(*, expert: bool) -> Any:
    """The group a parameter's tensor-parallel shards live in: expert-TP for experts, else TP (checked: 0.16.1, 0.19.2)."""
    from megatron.core import parallel_state

    if expert:
        return parallel_state.get_expert_tensor_parallel_group()
    return parallel_state.get_tensor_model_parallel_group()


def partition_dim(param: torch.Tensor) -> int | None:
    """The dim a tensor-parallel parameter is split along, or None when every TP rank holds it whole.

    ``tensor_model_parallel`` and ``partition_dim`` are set by ``set_tensor_model_parallel_attributes``
    (checked: 0.16.1, 0.19.2).
    """
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return int(param.partition_dim)


def attention_numbers(config: Any) -> tuple[int, int, int]:
    """(heads, key/value groups, head size) from a ``TransformerConfig`` (checked: 0.16.1, 0.19.2)."""
    heads = int(config.num_attention_heads)
    groups = int(config.num_query_groups or heads)
    head_dim = int(config.kv_channels or config.hidden_size // heads)
    return heads, groups, head_dim


def is_gated(config: Any) -> bool:
    """Whether ``linear_fc1`` holds [gate; up] per TP shard (``TransformerConfig.gated_linear_unit``; checked: 0.16.1, 0.19.2)."""
    return bool(getattr(config, "gated_linear_unit", False))


def stream_coordinates() -> dict[str, int]:
    """This rank's tensor, expert-tensor and expert-data parallel ranks (``parallel_state``; checked: 0.16.1, 0.19.2)."""
    from megatron.core import parallel_state

    return {
        "tensor": parallel_state.get_tensor_model_parallel_rank(),
        "expert_tensor": parallel_state.get_expert_tensor_parallel_rank(),
        "expert_data": parallel_state.get_expert_data_parallel_rank(),
    }


def main_param_pairs(leaf: Any) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(model param, this rank's part of it, its fp32 main param) for each float16 param with a main copy.

    ``Float16OptimizerWithFloat16Params``: ``float16_groups`` / ``fp32_from_float16_groups``, whole
    params. ``DistributedOptimizer``: ``model_float16_groups`` / ``shard_fp32_from_float16_groups``,
    the part at ``_get_model_param_range_map(param)["param"]`` (what ``_copy_main_params_to_model_params``
    writes). None main params (the precision-aware optimizer) and other kinds give no pairs.
    Checked: 0.16.1, 0.19.2.
    """
    _, optim = _megatron()
    if getattr(leaf, "is_stub_optimizer", False):
        return []
    pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    if isinstance(leaf, optim.DistributedOptimizer):
        for model_group, main_group in zip(leaf.model_float16_groups, leaf.shard_fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                if main_param is None:
                    return []
                part = leaf._get_model_param_range_map(model_param)["param"]
                pairs.append((model_param, model_param.detach().view(-1)[part.start : part.end], main_param))
    elif isinstance(leaf, optim.Float16OptimizerWithFloat16Params):
        for model_group, main_group in zip(leaf.float16_groups, leaf.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                pairs.append((model_param, model_param.detach(), main_param))
    return pairs


def copy_main_params_to_model_params(leaf: Any) -> None:
    """Megatron's own main -> model param copy, the one its step ends with (checked: 0.16.1, 0.19.2).

    ``MixedPrecisionOptimizer._copy_main_params_to_model_params``: ``copy_`` (round to nearest) of
    each main param into its model param, or into this rank's part of the DDP param buffer.
    """
    if not getattr(leaf, "is_stub_optimizer", False):
        leaf._copy_main_params_to_model_params()


def is_distributed_optimizer(leaf: Any) -> bool:
    """Whether a leaf shards its main params across the data-parallel ranks (checked: 0.16.1, 0.19.2)."""
    _, optim = _megatron()
    return isinstance(leaf, optim.DistributedOptimizer)


def gather_params(chunk: torch.nn.Module) -> None:
    """All-gather the DDP param buffers from every rank's part, now (a collective of the DP group).

    ``DistributedDataParallel.start_param_sync(force_sync=True)``, what the distributed optimizer's
    step runs without ``overlap_param_gather`` (checked: 0.16.1, 0.19.2).
    """
    if is_ddp(chunk):
        chunk.start_param_sync(force_sync=True)


def buffer_params(buffer: Any) -> list[torch.Tensor]:
    """The params a DDP buffer holds (``_ParamAndGradBuffer.params``; checked: 0.16.1, 0.19.2)."""
    return list(buffer.params)


def overlaps_param_gather(chunk: torch.nn.Module) -> bool:
    """Whether the DDP chunk gathers params in the next forward (``ddp_config.overlap_param_gather``; checked: 0.16.1, 0.19.2)."""
    return is_ddp(chunk) and bool(chunk.ddp_config.overlap_param_gather)


def optimizer_buffers(leaf: Any) -> list[Any]:
    """The DDP buffers a distributed optimizer steps on (``DistributedOptimizer.buffers``; checked: 0.16.1, 0.19.2).

    Every param in them is optimized by one of the data-parallel ranks, whose part of the buffer
    the all-gather of ``start_param_sync`` brings to every rank.
    """
    if not is_distributed_optimizer(leaf) or getattr(leaf, "is_stub_optimizer", False):
        return []
    return list(leaf.buffers)


def data_parallel_group(leaf: Any) -> Any:
    """The group a distributed optimizer shards its main params over (``.data_parallel_group``; checked: 0.16.1, 0.19.2)."""
    return leaf.data_parallel_group


def expert_parallel_layout() -> dict[str, int]:
    """This rank's expert-parallel rank and the sizes deciding who streams what (``parallel_state``; checked: 0.16.1).

    ``expert_tensor_parallel_size`` defaults to the tensor-parallel size; when they are equal, the ranks of a
    tensor-parallel group are one expert-tensor-parallel group and share an expert-parallel rank. Without
    ``initialize_model_parallel`` every size is 1.
    """
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return {"expert_rank": 0, "expert_size": 1, "expert_tensor_size": 1, "tensor_size": 1}
    return {
        "expert_rank": parallel_state.get_expert_model_parallel_rank(),
        "expert_size": parallel_state.get_expert_model_parallel_world_size(),
        "expert_tensor_size": parallel_state.get_expert_tensor_parallel_world_size(),
        "tensor_size": parallel_state.get_tensor_model_parallel_world_size(),
    }


def grouped_expert_linear(name: str) -> str | None:
    """``linear_fc1`` / ``linear_fc2`` for a legacy ``GroupedMLP`` weight (``experts.weight1`` / ``weight2``), else None.

    Checked: 0.16.1 only (0.19.2 not read), where ``GroupedMLP`` needs the ``grouped_gemm`` package.
    ``TEGroupedMLP`` (Transformer Engine) names its weights ``linear_fc1.weight{e}`` and is not handled here.
    """
    if name.endswith(".mlp.experts.weight1"):
        return "linear_fc1"
    if name.endswith(".mlp.experts.weight2"):
        return "linear_fc2"
    return None


def grouped_expert_shards(param: torch.Tensor, linear: str, num_local_experts: int) -> list[torch.Tensor]:
    """Per local expert, the shard a SequentialMLP expert would hold, as views of a ``GroupedMLP`` weight.

    ``GroupedMLP`` (checked: 0.16.1 only) keeps its local experts in ``weight1`` ``[H, E_local * 2I / etp]`` and
    ``weight2`` ``[E_local * I / etp, H]`` and computes with ``weight1.view(E_local, H, -1)`` /
    ``weight2.view(E_local, -1, H)``: a reinterpretation of the memory, not a split along a dim. Transposed,
    expert ``e`` is ``linear_fc1`` ``[2I / etp, H]`` ([gate; up] rows, split along dim 0 across expert-TP)
    and ``linear_fc2`` ``[H, I / etp]`` (split along dim 1): the layout its ``sharded_state_dict`` checkpoints.
    """
    weight = param.detach()
    if linear == "linear_fc1":
        per_expert = weight.view(num_local_experts, weight.shape[0], -1)
    else:
        per_expert = weight.view(num_local_experts, -1, weight.shape[1])
    return [expert.t() for expert in per_expert]
