"""Published model weight shapes (Qwen3 family) for benchmarks and demos, built without downloads."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecoderConfig:
    """The config fields that fix a Qwen3-style decoder's weight shapes (from its published config.json)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool


QWEN3_0_6B = DecoderConfig("Qwen3-0.6B", 1024, 3072, 28, 16, 8, 128, 151936, True)
QWEN3_8B = DecoderConfig("Qwen3-8B", 4096, 12288, 36, 32, 8, 128, 151936, False)
TINY = DecoderConfig("tiny", 256, 688, 4, 4, 2, 64, 4096, False)
CONFIGS = {c.name: c for c in (QWEN3_0_6B, QWEN3_8B, TINY)}


def weight_shapes(config: DecoderConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every weight, in the order a HF checkpoint lists them."""
    h, q, kv = (
        config.hidden_size,
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    )
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (config.vocab_size, h))]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "self_attn.q_norm.weight", (config.head_dim,)),
            (p + "self_attn.k_norm.weight", (config.head_dim,)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (config.intermediate_size, h)),
            (p + "mlp.up_proj.weight", (config.intermediate_size, h)),
            (p + "mlp.down_proj.weight", (h, config.intermediate_size)),
        ]
    shapes.append(("model.norm.weight", (h,)))
    if not config.tie_word_embeddings:
        shapes.append(("lm_head.weight", (config.vocab_size, h)))
    return shapes


def total_bytes(config: DecoderConfig, dtype: torch.dtype = torch.bfloat16) -> int:
    itemsize = torch.empty(0, dtype=dtype).element_size()
    total = 0
    for _, shape in weight_shapes(config):
        numel = 1
        for dim in shape:
            numel *= dim
        total += numel * itemsize
    return total


def make_weights(
    config: DecoderConfig, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random weights with the config's shapes (one tensor, one storage each)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return {
        name: torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(dtype)
        if torch.device(device).type == "cpu"
        else torch.randn(shape, generator=generator, device=device, dtype=dtype)
        for name, shape in weight_shapes(config)
    }
