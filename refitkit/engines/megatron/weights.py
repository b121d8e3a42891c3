"""Full weights of Megatron model chunks, one at a time: tensor-parallel shards gathered, global names.

What a rank yields: the experts its expert-parallel rank owns, each gathered over its expert-TP
group (never across expert-parallel ranks), and, on expert-parallel rank 0 only, the dense
(non-expert) weights of its own pipeline stage (every virtual chunk it holds), each gathered over
its TP group. Every rank of a TP group yields the same tensors, so a receiver gets every weight
exactly once from one sender per (pipeline stage, expert-parallel rank): the ranks
``is_stream_source()`` picks; the streams of those senders together are the whole model. Names
carry global layer and expert numbers: Megatron's own (``hf_family=None``) or Hugging Face's
(``hf_layouts``). Legacy ``GroupedMLP`` experts stream one expert at a time under SequentialMLP's
names and layout (``local_experts.{e}.linear_fc1.weight``), as Megatron's own checkpoints store them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from refitkit.engines.megatron import _internals, hf_layouts
from refitkit.errors import InvalidInput

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


def _gather(shard: torch.Tensor, dim: int | None, *, expert: bool, gated: bool) -> torch.Tensor:
    """The whole tensor in Megatron's TP=1 layout; every rank of the group must call this in the same order."""
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


def _stream_names(local_name: str, layers: list[int], experts: dict[int, list[int]]) -> tuple[str | None, list[str]]:
    """The global names one parameter streams as: its own, or one per local expert for a GroupedMLP weight.

    Also returns which linear a GroupedMLP weight holds (None for any other parameter).
    """
    name = _global_name(local_name, layers, experts)
    linear = _internals.grouped_expert_linear(name)
    if linear is None:
        return None, [name]
    prefix = name[: -len("weight1")]  # "decoder.layers.{layer}.mlp.experts."
    local_layer = int(_LOCAL_LAYER.match(local_name).group(1))
    return linear, [f"{prefix}local_experts.{expert}.{linear}.weight" for expert in experts[local_layer]]


def _streams_dense_weights() -> bool:
    """Whether this rank yields the dense weights: expert-parallel rank 0 of its stage does, the others do not.

    A TP group then skips or gathers a dense weight as one (its ranks share an expert-parallel rank),
    which holds only while the expert-TP size equals the TP size: anything else is refused here.
    """
    layout = _internals.expert_parallel_layout()
    if layout["expert_size"] > 1 and layout["expert_tensor_size"] != layout["tensor_size"]:
        raise InvalidInput(
            "MegatronAdapter.named_weights(): "
            f"expert_tensor_parallel_size={layout['expert_tensor_size']} differs from "
            f"tensor_model_parallel_size={layout['tensor_size']} "
            f"with expert_model_parallel_size={layout['expert_size']}; "
            "the stream supports expert parallelism only with expert_tensor_parallel_size equal to the TP size "
            "(its default); nothing was gathered"
        )
    return layout["expert_rank"] == 0


def global_names(chunks: Sequence[torch.nn.Module]) -> list[str]:
    """The names ``iter_full_weights(hf_family=None)`` will yield on this rank, without touching a tensor."""
    dense = _streams_dense_weights()
    names = []
    for chunk in chunks:
        model = _internals.unwrap_model(chunk)
        layers, experts = _internals.layer_numbers(model), _internals.expert_numbers(model)
        for local_name, _ in model.named_parameters():
            if _internals.is_tied_output_copy(model, local_name):
                continue
            if dense or ".mlp.experts." in local_name:
                names += _stream_names(local_name, layers, experts)[1]
    return names


def iter_full_weights(
    chunks: Sequence[torch.nn.Module], *, hf_family: str | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every weight this rank streams, one gathered tensor at a time.

    Refused here, before the first gather: an expert-parallel layout the stream cannot split once,
    and with ``hf_family`` names the table cannot map. Every rank of a TP group holds the same names
    and layout, so all refuse together and none waits in a collective.
    """
    dense = _streams_dense_weights()
    if hf_family is not None:
        hf_layouts.check_names(global_names(chunks), hf_family)
    return _iter_full_weights(chunks, hf_family, dense=dense)


def _iter_full_weights(
    chunks: Sequence[torch.nn.Module], hf_family: str | None, *, dense: bool
) -> Iterator[tuple[str, torch.Tensor]]:
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
            is_expert = ".mlp.experts." in local_name
            if not is_expert and not dense:
                continue  # expert-parallel rank 0 of this stage streams it, gathered by its own TP group
            linear, names = _stream_names(local_name, layers, experts)
            if linear is None:
                pieces = [(names[0], param.detach(), _internals.partition_dim(param), ".linear_fc1." in names[0])]
            else:
                # GroupedMLP's TP attributes are set only when Megatron initialises the weights: use its layout
                dim = 0 if linear == "linear_fc1" else 1
                shards = _internals.grouped_expert_shards(param, linear, len(names))
                pieces = [(name, shard, dim, linear == "linear_fc1") for name, shard in zip(names, shards)]
            for name, shard, dim, is_fc1 in pieces:
                full = _gather(shard, dim, expert=is_expert, gated=gated and is_fc1)
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
    Each source yields its part (dense weights only on expert-parallel rank 0, experts from their
    owner), so the sources' streams together hold every weight exactly once per sync.
    """
    return all(rank == 0 for rank in _internals.stream_coordinates().values())
