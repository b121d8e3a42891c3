"""The Megatron -> Hugging Face tables on their own: grouped qkv rows, gate/up halves, numbering, bad input."""

from __future__ import annotations

import pytest
import torch

from refitkit.engines.megatron import hf_layouts
from refitkit.engines.megatron.hf_layouts import AttentionShape
from refitkit.errors import InvalidInput

pytestmark = pytest.mark.timeout(60)


def _labelled_qkv(shape: AttentionShape, hidden: int) -> torch.Tensor:
    """Megatron's qkv rows with each row's value saying what it is: 1000*kind + 100*head + row in head."""
    rows = []
    per_group = shape.num_heads // shape.num_query_groups
    for group in range(shape.num_query_groups):
        for slot in range(per_group + 2):
            kind, head = (0, group * per_group + slot) if slot < per_group else (slot - per_group + 1, group)
            for row in range(shape.head_dim):
                rows.append(torch.full((hidden,), 1000.0 * kind + 100 * head + row))
    return torch.stack(rows)


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (8, 1)])
def test_split_qkv_takes_each_head_from_its_group(heads: int, groups: int) -> None:
    shape = AttentionShape(num_heads=heads, num_query_groups=groups, head_dim=3)
    q, k, v = hf_layouts.split_qkv(_labelled_qkv(shape, hidden=5), shape)
    assert q.shape == (heads * 3, 5) and k.shape == v.shape == (groups * 3, 5)
    expected_q = torch.tensor([100.0 * h + r for h in range(heads) for r in range(3)])
    expected_k = torch.tensor([1000.0 + 100 * g + r for g in range(groups) for r in range(3)])
    assert torch.equal(q[:, 0], expected_q)
    assert torch.equal(k[:, 0], expected_k)
    assert torch.equal(v[:, 0], expected_k + 1000)
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()


def test_to_hf_names_layers_experts_and_halves() -> None:
    shape = AttentionShape(num_heads=2, num_query_groups=1, head_dim=2)
    fc1 = torch.arange(8.0).reshape(4, 2)
    pairs = list(
        hf_layouts.to_hf("decoder.layers.7.mlp.experts.local_experts.5.linear_fc1.weight", fc1, "qwen3_moe", shape)
    )
    assert [name for name, _ in pairs] == [
        "model.layers.7.mlp.experts.5.gate_proj.weight",
        "model.layers.7.mlp.experts.5.up_proj.weight",
    ]
    assert torch.equal(pairs[0][1], fc1[:2]) and torch.equal(pairs[1][1], fc1[2:])
    bias = torch.arange(8.0)
    names = [n for n, _ in hf_layouts.to_hf("decoder.layers.0.self_attention.linear_qkv.bias", bias, "qwen2", shape)]
    assert names == [f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv"]
    router = [n for n, _ in hf_layouts.to_hf("decoder.layers.3.mlp.router.weight", fc1, "qwen3_moe", shape)]
    assert router == ["model.layers.3.mlp.gate.weight"]


def test_unknown_names_and_families_are_refused() -> None:
    shape = AttentionShape(num_heads=2, num_query_groups=1, head_dim=2)
    with pytest.raises(
        InvalidInput,
        match=r"'decoder.layers.0.mystery.weight' of shape \(2, 2\) has no Hugging Face name in the 'llama' table",
    ):
        list(hf_layouts.to_hf("decoder.layers.0.mystery.weight", torch.zeros(2, 2), "llama", shape))
    with pytest.raises(InvalidInput, match=r"hf_family='gpt2' has no Megatron -> Hugging Face table"):
        hf_layouts.table("gpt2")
    with pytest.raises(InvalidInput, match=r"linear_qkv has 6 rows; .* needs 8 rows"):
        hf_layouts.split_qkv(torch.zeros(6, 2), shape)
