"""Full weights of Megatron model chunks, one at a time: tensor-parallel shards gathered, global names.

What a rank yields: the weights of its own pipeline stage (every virtual chunk it holds) and of
the experts its expert-parallel rank owns, each gathered over its tensor-parallel group (the
expert-TP group for experts); experts are never gathered across expert-parallel ranks. Every rank
of a TP group yields the same tensors, so a receiver gets every weight from one sender per
(pipeline stage, expert-parallel rank): the ranks ``is_stream_source()`` picks. Names carry global
layer and expert numbers: Megatron's own (``hf_family=None``) or Hugging Face's (``hf_layouts``)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from refitkit.engines.megatron import _internals, hf_layouts

_LOCAL_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.")


def _global_name(name: str, layers: list[int], experts: dict[int, list[int]]) -> str:
    """``decoder.layers.{local}`` and ``local_experts.{local}`` renumbered to the whole model's numbers."""
    match = _LOCAL_LAYER.match(name)
    if match is None:
        return name
    local = int(match.group(1))
    rest = name[match.end() :]
    expert = _LOCAL_EXPERT.match(rest)
    if expert is not None:
        rest = f"mlp.experts.local_experts.{experts[local][int(expert.group(1))]}." + rest[expert.end() :]
    return f"decoder.layers.{layers[local]}." + rest


def _gather(param: torch.Tensor, *, expert: bool, gated: bool) -> torch.Tensor:
    """The whole tensor in Megatron's TP=1 layout; every rank of the group must call this in the same order."""
    dim = _internals.partition_dim(param)
    shard = param.detach()
    if dim is None:
        return shard
    group = _internals.tensor_parallel_group(expert=expert)
    size = dist.get_world_size(group)
    if size == 1:
        return shard
    shard = shard.contiguous()
    shards = [torch.empty_like(shard) for _ in range(size)]
    dist.all_gather(shards, shard, group=group)
    if gated:
        # each shard holds [its gate rows; its up rows]: regroup to [all gate; all up]
        halves = [s.chunk(2, dim=dim) for s in shards]
        shards = [gate for gate, _ in halves] + [up for _, up in halves]
    return torch.cat(shards, dim=dim)


def global_names(chunks: Sequence[torch.nn.Module]) -> list[str]:
    """The names ``iter_full_weights(hf_family=None)`` will yield on this rank, without touching a tensor."""
    names = []
    for chunk in chunks:
        model = _internals.unwrap_model(chunk)
        layers, experts = _internals.layer_numbers(model), _internals.expert_numbers(model)
        names += [
            _global_name(name, layers, experts)
            for name, _ in model.named_parameters()
            if not _internals.is_tied_output_copy(model, name)
        ]
    return names


def iter_full_weights(
    chunks: Sequence[torch.nn.Module], *, hf_family: str | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every weight this rank's chunks hold, one gathered tensor at a time.

    With ``hf_family``, names the table cannot map are refused here, before the first gather:
    every rank of a TP group holds the same names, so all refuse together and none waits in a collective.
    """
    if hf_family is not None:
        hf_layouts.check_names(global_names(chunks), hf_family)
    return _iter_full_weights(chunks, hf_family)


def _iter_full_weights(chunks: Sequence[torch.nn.Module], hf_family: str | None) -> Iterator[tuple[str, torch.Tensor]]:
    for chunk in chunks:
        model = _internals.unwrap_model(chunk)
        config = model.config
        layers = _internals.layer_numbers(model)
        experts = _internals.expert_numbers(model)
        gated = _internals.is_gated(config)
        shape = hf_layouts.AttentionShape(*_internals.attention_numbers(config))
        for local_name, param in model.named_parameters():
            if _internals.is_tied_output_copy(model, local_name):
                continue  # the embedding's stage streams it
            name = _global_name(local_name, layers, experts)
            is_expert = ".mlp.experts." in name
            full = _gather(param, expert=is_expert, gated=gated and ".linear_fc1." in name)
            if hf_family is None:
                yield name, full
            else:
                yield from hf_layouts.to_hf(name, full, hf_family, shape)
            del full  # bound memory to one gathered tensor while the consumer works on the next


def is_stream_source() -> bool:
    """Whether this rank is the one of its (pipeline stage, expert-parallel rank) that should send its weights.

    Tensor-parallel rank 0, expert-tensor-parallel rank 0 and expert-data-parallel rank 0: the
    other ranks of the slice hold the same gathered tensors. Every rank must still iterate
    ``named_weights()`` (the gathers are collectives); only the sources hand the tensors on.
    Dense weights come once per expert-parallel rank (each sends its stage's dense layers too).
    """
    return all(rank == 0 for rank in _internals.stream_coordinates().values())
