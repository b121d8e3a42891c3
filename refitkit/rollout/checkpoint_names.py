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
    """The Hugging Face names the checkpoint ``model`` holds (the names a full sync must deliver), or None: the keys of
    ``checkpoint_weight_shapes``."""
    shapes = checkpoint_weight_shapes(model, revision=revision, tied_embeddings=tied_embeddings)
    return None if shapes is None else frozenset(shapes)


def checkpoint_weight_shapes(
    model: str, *, revision: str | None, tied_embeddings: bool
) -> dict[str, tuple[int, ...]] | None:
    """Each weight's shape in the checkpoint ``model``, by Hugging Face name (what a sync into an engine that loaded it
    must deliver, in that shape), or None.

    Read from the safetensors files' headers (those the index lists, else every ``*.safetensors``).
    ``lm_head.weight`` is left out when the config ties it to the embedding (``tied_embeddings``: engines
    do not load it then, and a trainer's ``named_parameters()`` does not yield it). None for anything else
    (``.bin`` checkpoints, a cache miss): coverage and shapes are then unknown.
    """
    try:
        directory = _checkpoint_dir(model, revision)
        shapes = None if directory is None else _safetensors_shapes(directory)
    except (OSError, ValueError) as exc:
        log.warning("could not read the weights of checkpoint %r: %s; sync coverage is unknown", model, exc)
        return None
    if shapes is None:
        log.warning("checkpoint %r has no safetensors files here; sync coverage is unknown", model)
        return None
    if tied_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def _checkpoint_dir(model: str, revision: str | None) -> str | None:
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            model, revision=revision, local_files_only=True, allow_patterns=["*.safetensors", "*.json"]
        )
    except Exception as exc:  # any cache miss or hub error: no names, not a failed engine
        log.debug("checkpoint %r is not in the local cache: %s", model, exc)
        return None


def _safetensors_shapes(directory: str) -> dict[str, tuple[int, ...]] | None:
    """The tensor names and shapes of a local safetensors checkpoint (the headers of the files its index lists, else
    of every file); None without safetensors files. A malformed index or header is a ValueError naming the file (the
    caller then leaves coverage unknown)."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            weight_map = json.load(handle)
        if not isinstance(weight_map, dict) or not isinstance(weight_map.get("weight_map"), dict):
            raise ValueError(f"{index}: no weight_map object")
        files = sorted({str(file) for file in weight_map["weight_map"].values()})
    else:
        files = sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
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
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            shape = entry.get("shape") if isinstance(entry, dict) else None
            if not isinstance(shape, list) or not all(type(dim) is int for dim in shape):
                raise ValueError(f"{name}: tensor {key!r} has no shape list in its header")
            shapes[key] = tuple(shape)
    return shapes
