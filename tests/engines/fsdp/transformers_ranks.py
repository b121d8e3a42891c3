"""Tiny transformers 5 models (Mixture-of-Experts with fused experts, and dense ones) and the rank functions that
stream them through FSDPAdapter over real FSDP2, compared with what transformers' own ``save_pretrained()`` wrote.

Imports transformers inside functions: the module loads (for spawned ranks) wherever the tests that use it run.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from refitkit.engines.fsdp import FSDPAdapter
from tests.helpers.bits import bits_equal

# the fused-expert families whose conversion mapping these tests cover (transformers 5.18: qwen3_moe uses
# qwen2_moe's mapping; mixtral has its own, with renames of the block and of each projection)
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
VOCAB = 131  # odd: a 2-rank shard of the embedding carries padding


def tiny_model(family: str, *, seed: int = 0) -> nn.Module:
    """A randomly initialised tiny model of ``family`` (2 layers, GQA 4/2, hidden 64; MoE: 8 experts, width 32)."""
    import transformers

    torch.manual_seed(seed)
    shared = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **shared, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2
        )
        return transformers.Qwen3MoeForCausalLM(config)
    if family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **shared,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
        )
        return transformers.Qwen2MoeForCausalLM(config)
    if family == "mixtral":
        config = transformers.MixtralConfig(
            **shared, head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2
        )
        return transformers.MixtralForCausalLM(config)
    if family == "qwen3":  # dense, embeddings tied to the head
        config = transformers.Qwen3Config(**shared, head_dim=16, intermediate_size=96, tie_word_embeddings=True)
        return transformers.Qwen3ForCausalLM(config)
    if family == "llama":
        config = transformers.LlamaConfig(**shared, intermediate_size=96)
        return transformers.LlamaForCausalLM(config)
    raise ValueError(family)


def saved_checkpoint(model: nn.Module, directory: str) -> dict[str, torch.Tensor]:
    """What ``model.save_pretrained(directory)`` wrote, read back with safetensors."""
    from safetensors.torch import load_file

    model.save_pretrained(directory)
    return load_file(os.path.join(directory, "model.safetensors"))


def compare(streamed: list[tuple[str, torch.Tensor]], saved: dict[str, torch.Tensor]) -> dict:
    """The stream against a checkpoint: names (in order, and as sets), and which tensors differ in any bit."""
    names = [name for name, _ in streamed]
    return {
        "names": names,
        "saved_names": sorted(saved),
        "duplicates": sorted({name for name in names if names.count(name) > 1}),
        "unequal": [name for name, tensor in streamed if name in saved and not bits_equal(tensor, saved[name])],
    }


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(rank))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def sharded_stream_matches_save_pretrained(rank: int, world_size: int, tmp: str, family: str) -> dict:
    """FSDP2 per decoder layer and at the root, one AdamW step, then the stream against transformers' own checkpoint
    of the same trained weights (rank 0 loads the full state dict into an unsharded model and saves it)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_model(family)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, optimizer, rank)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        reference = tiny_model(family, seed=1)
        reference.load_state_dict(full)
        reference.save_pretrained(tmp)
    dist.barrier()
    from safetensors.torch import load_file

    saved = load_file(os.path.join(tmp, "model.safetensors"))
    weights = FSDPAdapter(model, optimizer).named_weights()
    streamed = list(weights)
    layer0 = [tensor for name, tensor in streamed if name.startswith("model.layers.0.") and ".experts." in name]
    return {
        **compare(streamed, saved),
        "sharded": sorted({type(param).__name__ for param in model.parameters()}),
        "types": sorted({type(tensor).__name__ for _, tensor in streamed}),
        # every expert tensor of a layer is a view of one gathered fused tensor per projection (gate_up, down):
        # one gather each, not one per expert
        "layer0_expert_tensors": len(layer0),
        "layer0_storages": len({tensor.untyped_storage().data_ptr() for tensor in layer0}),
        "says_held": getattr(weights, "refitkit_holds_tensors", False),
        "says_fresh": getattr(weights, "refitkit_fresh_tensors", False),
        "trained": not bits_equal(full["model.norm.weight"], tiny_model(family).state_dict()["model.norm.weight"]),
    }
