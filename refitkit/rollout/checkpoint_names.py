"""The weight names a Hugging Face checkpoint holds: what a full sync into an engine that loaded it must deliver.

Engine-neutral: the vLLM worker and the SGLang scheduler read their engine's checkpoint path and hand it here.
Nothing is downloaded: a local directory, or a hub id already in the local Hugging Face cache.
"""

from __future__ import annotations

import json
import logging
import os
import struct

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 100 << 20  # a safetensors header larger than this is not one we trust


def checkpoint_weight_names(model: str, *, revision: str | None, tied_embeddings: bool) -> frozenset[str] | None:
    """The Hugging Face names the checkpoint ``model`` holds (the names a full sync must deliver), or None.

    Read from the safetensors index, else each safetensors file's header. ``lm_head.weight`` is left out
    when the config ties it to the embedding (``tied_embeddings``: engines do not load it then, and a
    trainer's ``named_parameters()`` does not yield it). None for anything else (``.bin`` checkpoints, a
    cache miss): coverage is then unknown.
    """
    try:
        directory = _checkpoint_dir(model, revision)
        names = None if directory is None else _safetensors_names(directory)
    except (OSError, ValueError) as exc:
        log.warning("could not read the weight names of checkpoint %r: %s; sync coverage is unknown", model, exc)
        return None
    if names is None:
        log.warning("checkpoint %r has no safetensors files here; sync coverage is unknown", model)
        return None
    if tied_embeddings:
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
