"""Fewer bytes for mixed precision: bf16 model params dropped on offload, rebuilt from the fp32 main params.

A mixed-precision Megatron optimizer ends every step by casting its fp32 main params into the
bf16/fp16 model params (``_copy_main_params_to_model_params``), so between steps the model params
hold nothing the main params do not: they need not travel. Offload frees them without a copy;
reload regrows them and runs Megatron's own cast again (and, with the distributed optimizer, the
all-gather of the param buffers its step runs), which is bit-identical to what the next step
would see. Before dropping, the invariant is checked on the device (bf16(main) == model bits,
one synchronize); where it does not hold (a param written outside the optimizer), the params
travel as usual.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from refitkit.engines.megatron import _internals
from refitkit.engines.megatron.model import NamedTensors, chunk_label, model_tensors

logger = logging.getLogger(__name__)


MainPairs = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (model param, its part, main param) per leaf


def main_pairs(leaves: Sequence[object]) -> list[MainPairs]:
    """Each leaf optimizer's (model param, part, main param) triples: read once per offload, used twice."""
    return [_internals.main_param_pairs(leaf) for leaf in leaves]


def rebuildable_tensors(
    chunks: Sequence[torch.nn.Module], leaves: Sequence[object], pairs: list[MainPairs]
) -> NamedTensors:
    """The model tensors whose every byte the main params rebuild: 16-bit DDP param buffers and loose params.

    A 16-bit ``param_data`` buffer qualifies when a distributed optimizer steps on it (each of its
    params has a main copy on some data-parallel rank; the all-gather brings them all back); a
    param with its own storage when it has a main copy here. Module buffers, frozen params and
    fp32 params never do.
    """
    covered = {id(model) for leaf_pairs in pairs for model, _, _ in leaf_pairs}
    sharded = {id(buffer) for leaf in leaves for buffer in _internals.optimizer_buffers(leaf)}
    in_buffers: set[int] = set()
    named: NamedTensors = []
    for index, chunk in enumerate(chunks):
        for label, buffer in _internals.ddp_buffers(chunk):
            param_data = _internals.buffer_param_data(buffer)
            if param_data is None:
                continue  # without the distributed optimizer, params keep their own storages
            in_buffers.update(id(p) for p in _internals.buffer_params(buffer))
            if id(buffer) in sharded and param_data.dtype in (torch.bfloat16, torch.float16):
                named.append((f"{chunk_label(chunks, index)}.{label}.param_data", param_data))
    for name, tensor in model_tensors(chunks):
        if id(tensor) in in_buffers:
            continue  # inside a buffer: the buffer decides
        if isinstance(tensor, torch.nn.Parameter) and id(tensor) in covered:
            named.append((name, tensor))
    return named


def main_params_match(leaves: Sequence[object], pairs: list[MainPairs]) -> bool:
    """Whether every model param (this rank's part) holds exactly bf16/fp16(main param): one synchronize.

    With a distributed optimizer every data-parallel rank must decide alike (the rebuild ends in
    an all-gather), so the verdict is all-reduced over its group: a collective, as offload is.
    """
    parts = [(part, main) for leaf_pairs in pairs for _, part, main in leaf_pairs]
    device = parts[0][0].device if parts else None
    differs = torch.zeros((), dtype=torch.int32, device=device)
    with torch.no_grad():
        for part, main in parts:
            if part.numel() == 0:
                continue
            cast = main.detach().reshape(part.shape).to(part.dtype)
            # compare bits, not values: NaN payloads and -0.0 must survive the rebuild too
            differs |= (_as_bits(cast) != _as_bits(part)).any().to(torch.int32)
    groups = {
        id(g): g
        for leaf in leaves
        if _internals.is_distributed_optimizer(leaf)
        for g in [_internals.data_parallel_group(leaf)]
    }
    for group in groups.values():
        torch.distributed.all_reduce(differs, op=torch.distributed.ReduceOp.MAX, group=group)
    return not bool(differs.item())


def rebuild_model_params(chunks: Sequence[torch.nn.Module], leaves: Sequence[object]) -> None:
    """Cast the main params into the (regrown) model params, as Megatron's step does; then all-gather."""
    with torch.no_grad():
        for leaf in leaves:
            _internals.copy_main_params_to_model_params(leaf)
    if any(_internals.is_distributed_optimizer(leaf) for leaf in leaves):
        for chunk in chunks:
            _internals.gather_params(chunk)  # every rank rebuilt its part; the buffer needs them all


def _as_bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.int16 if tensor.element_size() == 2 else torch.uint8)
