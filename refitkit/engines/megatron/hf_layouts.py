"""Megatron GPTModel weights in Hugging Face names and layouts, one table per family.

A row maps a Megatron parameter name (with the layer and expert numbers already made global)
to Hugging Face names and says how the full, tensor-parallel-gathered tensor is cut:
``rename`` (as is), ``qkv`` (Megatron's grouped query/key/value rows into q, k, v) or
``gate_up`` (a SwiGLU ``linear_fc1`` into gate, up). Adding a family means adding a table.
Checked against transformers 5.18.0 (names, shapes, values) in tests/engines/megatron.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from refitkit.errors import InvalidInput

RENAME, QKV, GATE_UP = "rename", "qkv", "gate_up"


@dataclass(frozen=True)
class AttentionShape:
    """What the qkv cut needs: heads, key/value groups and the head size (Megatron's kv_channels)."""

    num_heads: int
    num_query_groups: int
    head_dim: int


@dataclass(frozen=True)
class Row:
    """One Megatron name pattern and the Hugging Face names it becomes (``{layer}`` / ``{expert}`` filled in)."""

    pattern: str
    cut: str
    targets: tuple[str, ...]


_LAYER = r"decoder\.layers\.(?P<layer>\d+)\."
_EXPERT = r"mlp\.experts\.local_experts\.(?P<expert>\d+)\."
_HF_LAYER = "model.layers.{layer}."

# Llama, Qwen2, Qwen3, Qwen2-MoE and Qwen3-MoE share these names; a row whose Megatron name a model
# lacks (q/k norms, qkv bias, router, shared experts) never matches, so one table serves them all.
LLAMA_LIKE: tuple[Row, ...] = (
    Row(r"embedding\.word_embeddings\.weight", RENAME, ("model.embed_tokens.weight",)),
    Row(r"decoder\.final_layernorm\.weight", RENAME, ("model.norm.weight",)),
    Row(r"output_layer\.weight", RENAME, ("lm_head.weight",)),
    Row(_LAYER + r"input_layernorm\.weight", RENAME, (_HF_LAYER + "input_layernorm.weight",)),
    # Transformer-Engine specs fuse the norms into the following linear
    Row(_LAYER + r"self_attention\.linear_qkv\.layer_norm_weight", RENAME, (_HF_LAYER + "input_layernorm.weight",)),
    Row(_LAYER + r"pre_mlp_layernorm\.weight", RENAME, (_HF_LAYER + "post_attention_layernorm.weight",)),
    Row(_LAYER + r"mlp\.linear_fc1\.layer_norm_weight", RENAME, (_HF_LAYER + "post_attention_layernorm.weight",)),
    Row(
        _LAYER + r"self_attention\.linear_qkv\.(?P<kind>weight|bias)",
        QKV,
        tuple(_HF_LAYER + f"self_attn.{p}_proj.{{kind}}" for p in "qkv"),
    ),
    Row(_LAYER + r"self_attention\.linear_proj\.weight", RENAME, (_HF_LAYER + "self_attn.o_proj.weight",)),
    Row(_LAYER + r"self_attention\.q_layernorm\.weight", RENAME, (_HF_LAYER + "self_attn.q_norm.weight",)),
    Row(_LAYER + r"self_attention\.k_layernorm\.weight", RENAME, (_HF_LAYER + "self_attn.k_norm.weight",)),
    Row(
        _LAYER + r"mlp\.linear_fc1\.weight",
        GATE_UP,
        (_HF_LAYER + "mlp.gate_proj.weight", _HF_LAYER + "mlp.up_proj.weight"),
    ),
    Row(_LAYER + r"mlp\.linear_fc2\.weight", RENAME, (_HF_LAYER + "mlp.down_proj.weight",)),
    Row(_LAYER + r"mlp\.router\.weight", RENAME, (_HF_LAYER + "mlp.gate.weight",)),
    Row(
        _LAYER + _EXPERT + r"linear_fc1\.weight",
        GATE_UP,
        (_HF_LAYER + "mlp.experts.{expert}.gate_proj.weight", _HF_LAYER + "mlp.experts.{expert}.up_proj.weight"),
    ),
    Row(_LAYER + _EXPERT + r"linear_fc2\.weight", RENAME, (_HF_LAYER + "mlp.experts.{expert}.down_proj.weight",)),
    Row(
        _LAYER + r"mlp\.shared_experts\.linear_fc1\.weight",
        GATE_UP,
        (_HF_LAYER + "mlp.shared_expert.gate_proj.weight", _HF_LAYER + "mlp.shared_expert.up_proj.weight"),
    ),
    Row(
        _LAYER + r"mlp\.shared_experts\.linear_fc2\.weight", RENAME, (_HF_LAYER + "mlp.shared_expert.down_proj.weight",)
    ),
    Row(_LAYER + r"mlp\.shared_experts\.gate_weight", RENAME, (_HF_LAYER + "mlp.shared_expert_gate.weight",)),
)

FAMILIES: dict[str, tuple[Row, ...]] = {
    "llama": LLAMA_LIKE,
    "qwen2": LLAMA_LIKE,
    "qwen3": LLAMA_LIKE,
    "qwen2_moe": LLAMA_LIKE,
    "qwen3_moe": LLAMA_LIKE,
}

_COMPILED: dict[str, list[tuple[re.Pattern[str], Row]]] = {}


def table(family: str) -> list[tuple[re.Pattern[str], Row]]:
    """The compiled rows of a family, by its Hugging Face ``model_type``."""
    if family not in FAMILIES:
        raise InvalidInput(
            f"hf_family={family!r} has no Megatron -> Hugging Face table; known: {sorted(FAMILIES)} "
            "(add one in refitkit/engines/megatron/hf_layouts.py)"
        )
    if family not in _COMPILED:
        _COMPILED[family] = [(re.compile(row.pattern + r"\Z"), row) for row in FAMILIES[family]]
    return _COMPILED[family]


def check_names(names: list[str], family: str) -> None:
    """Refuse, before any tensor moves, a model whose parameters the family's table cannot name."""
    rows = table(family)
    unnamed = [name for name in names if not any(pattern.match(name) for pattern, _ in rows)]
    if unnamed:
        raise InvalidInput(
            f"{len(unnamed)} Megatron parameter(s) have no Hugging Face name in the {family!r} table, e.g. "
            f"{unnamed[:3]} (refitkit/engines/megatron/hf_layouts.py); pass hf_family=None for Megatron names"
        )


def split_qkv(full: torch.Tensor, shape: AttentionShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's qkv rows, grouped per key/value group as [q of the group, k, v], into q, k, v (GQA included)."""
    heads_per_group = shape.num_heads // shape.num_query_groups
    rows = (heads_per_group + 2) * shape.head_dim * shape.num_query_groups
    if shape.num_heads % shape.num_query_groups or full.shape[0] != rows:
        raise InvalidInput(
            f"linear_qkv has {full.shape[0]} rows; {shape} needs {rows} rows (num_heads a multiple of num_query_groups)"
        )
    grouped = full.reshape(shape.num_query_groups, heads_per_group + 2, shape.head_dim, *full.shape[1:])
    q = grouped[:, :heads_per_group].reshape(shape.num_heads * shape.head_dim, *full.shape[1:])
    k = grouped[:, heads_per_group].reshape(shape.num_query_groups * shape.head_dim, *full.shape[1:])
    v = grouped[:, heads_per_group + 1].reshape(shape.num_query_groups * shape.head_dim, *full.shape[1:])
    return q.contiguous(), k.contiguous(), v.contiguous()


def to_hf(name: str, full: torch.Tensor, family: str, shape: AttentionShape) -> Iterator[tuple[str, torch.Tensor]]:
    """The Hugging Face (name, tensor) pairs of one full Megatron tensor (TP=1 layout, global numbers)."""
    for pattern, row in table(family):
        match = pattern.match(name)
        if match is None:
            continue
        fields = match.groupdict()
        names = [target.format(**fields) for target in row.targets]
        if row.cut == RENAME:
            yield names[0], full
        elif row.cut == QKV:
            yield from zip(names, split_qkv(full, shape))
        else:
            gate, up = full.chunk(2, dim=0)
            yield names[0], gate
            yield names[1], up
        return
    raise InvalidInput(
        f"Megatron parameter {name!r} of shape {tuple(full.shape)} has no Hugging Face name in the {family!r} table "
        "(refitkit/engines/megatron/hf_layouts.py); pass hf_family=None for Megatron names"
    )
