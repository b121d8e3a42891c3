"""Megatron model chunks: which tensors they hold, and offload / load of them through refitkit.offload.

A DDP chunk keeps its params in each buffer's flat ``param_data`` (with the distributed
optimizer) and its grads in the flat ``grad_data`` that every ``param.main_grad`` views.
Params outside those buffers (frozen ones such as a LoRA base, or every param of a model
without DDP) and module buffers are moved per storage too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from refitkit.engines.megatron import _internals
from refitkit.engines.megatron._arenas import arena_groups
from refitkit.errors import InvalidInput
from refitkit.offload import (
    HostArena,
    MoveStats,
    drop_tensors,
    flush_device,
    offload_tensors,
    regrow_tensors,
    reload_tensors,
)
from refitkit.offload.stats import EMPTY_MOVE

logger = logging.getLogger(__name__)

NamedTensors = list[tuple[str, torch.Tensor]]
Models = torch.nn.Module | Sequence[torch.nn.Module]


def as_chunks(models: Models) -> list[torch.nn.Module]:
    """A model chunk or a list of them (virtual pipeline stages), validated."""
    chunks = [models] if isinstance(models, torch.nn.Module) else list(models)
    if not chunks:
        raise InvalidInput("models is empty: pass a Megatron model chunk or a list of them")
    return [_internals.check_model_chunk(chunk, f"models[{i}]") for i, chunk in enumerate(chunks)]


def chunk_label(chunks: Sequence[torch.nn.Module], index: int) -> str:
    return f"models[{index}]" if len(chunks) > 1 else "model"


def model_tensors(chunks: Sequence[torch.nn.Module]) -> NamedTensors:
    """Every tensor holding model memory: DDP ``param_data`` buffers, params outside them, module buffers."""
    named: NamedTensors = []
    for index, chunk in enumerate(chunks):
        prefix = chunk_label(chunks, index)
        for label, buffer in _internals.ddp_buffers(chunk):
            param_data = _internals.buffer_param_data(buffer)
            if param_data is not None:
                named.append((f"{prefix}.{label}.param_data", param_data))
        # params inside a param_data buffer share its storage, which the offload core moves once
        named.extend((f"{prefix}.{name}", p) for name, p in chunk.named_parameters())
        named.extend((f"{prefix}.{name}", b) for name, b in chunk.named_buffers() if b is not None)
    return named


def grad_buffer_tensors(chunks: Sequence[torch.nn.Module]) -> NamedTensors:
    """Each DDP buffer's flat ``grad_data`` (what ``param.main_grad`` views), unless it is the param storage.

    With MXFP8 params Megatron shares one storage between params and grads; that storage
    belongs to the model part, so it is left out here.
    """
    named: NamedTensors = []
    for index, chunk in enumerate(chunks):
        for label, buffer in _internals.ddp_buffers(chunk):
            grad_data = _internals.buffer_grad_data(buffer)
            param_data = _internals.buffer_param_data(buffer)
            if grad_data is None:
                continue
            if param_data is not None and param_data.untyped_storage()._cdata == grad_data.untyped_storage()._cdata:
                continue
            named.append((f"{chunk_label(chunks, index)}.{label}.grad_data", grad_data))
    return named


def loose_grads(chunks: Sequence[torch.nn.Module]) -> NamedTensors:
    """``param.grad`` tensors outside DDP grad buffers (a model without DDP), as (name, param)."""
    return [
        (f"{chunk_label(chunks, index)}.{name}", p)
        for index, chunk in enumerate(chunks)
        for name, p in chunk.named_parameters()
        if p.grad is not None
    ]


def drop_grads(chunks: Sequence[torch.nn.Module], arena: HostArena) -> int:
    """Free grad buffers without copying them (they are rebuilt zeroed on load); returns bytes freed.

    Call only after the phase's synchronize: a grad reduction may still be reading them.
    """
    # views (param.main_grad, bucket.grad_data) stay valid objects over the freed storage
    freed = drop_tensors(grad_buffer_tensors(chunks), arena)
    for _, param in loose_grads(chunks):
        param.grad = None
    return freed


def kept_grad_tensors(chunks: Sequence[torch.nn.Module], arena: HostArena) -> NamedTensors:
    """The grad tensors whose bytes this arena holds (offloaded with keep), to be copied back."""
    named = [
        (name, t)
        for name, t in grad_buffer_tensors(chunks)
        if (slot := arena.slot_of(t.untyped_storage())) is not None and slot.holds_data
    ]
    named.extend((f"{name}.grad", p.grad) for name, p in loose_grads(chunks))
    return named


def regrow_grads(chunks: Sequence[torch.nn.Module], arena: HostArena, *, zero_all: bool = False) -> int:
    """Reallocate dropped grad buffers in place, zeroed (``zero_all``: zero the restored ones too)."""
    buffers = grad_buffer_tensors(chunks)
    regrown = regrow_tensors(buffers, arena, zero=True)
    if zero_all:
        for _, grad_data in buffers:
            grad_data.zero_()
        for _, param in loose_grads(chunks):
            param.grad.zero_()
    return regrown


def offload_megatron_model_to_cpu(models: Models, *, keep_grad: bool = False) -> MoveStats:
    """Move every chunk's params and module buffers to its pinned host arena and free the device copies.

    Grad buffers are freed without a copy (rebuilt zeroed by ``load_megatron_model_to_gpu``), or
    copied to the arena too with ``keep_grad=True``. Tensor identities and views stay valid. One
    synchronize + empty_cache per call. The arena is kept per chunk between calls (see
    ``arena_of``). Returns the bytes copied.
    """
    chunks = as_chunks(models)
    total = EMPTY_MOVE
    for arena, members in arena_groups(chunks):
        members = list(members)
        named = model_tensors(members)
        if keep_grad:
            named += grad_buffer_tensors(members)
            named += [(f"{name}.grad", p.grad) for name, p in loose_grads(members)]
        total = total + offload_tensors(named, arena)
        if not keep_grad:
            drop_grads(members, arena)
    flush_device()
    logger.debug("offload_megatron_model_to_cpu: %d bytes in %.4f s", total.bytes, total.seconds)
    return total


def load_megatron_model_to_gpu(models: Models, load_grad: bool = True) -> MoveStats:
    """Copy every chunk's params and buffers back in place; with ``load_grad`` also its grad buffers.

    Grad buffers offloaded with ``keep_grad`` are restored; dropped ones are reallocated zeroed.
    ``load_grad=False`` leaves grads freed (params only, e.g. for generation); a later call with
    ``load_grad=True`` brings them back. One synchronize + empty_cache per call.
    """
    chunks = as_chunks(models)
    total = EMPTY_MOVE
    for arena, members in arena_groups(chunks):
        members = list(members)
        named = model_tensors(members)
        if load_grad:
            named += kept_grad_tensors(members, arena)
        total = total + reload_tensors(named, arena)
        if load_grad:
            regrow_grads(members, arena)
    flush_device()
    logger.debug("load_megatron_model_to_gpu: %d bytes in %.4f s", total.bytes, total.seconds)
    return total
