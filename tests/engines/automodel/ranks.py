"""Rank functions for the Automodel adapter tests: a tiny HF Llama parallelized by NeMo Automodel.

The model is built locally from a ``LlamaConfig`` (no hub download) and handed to Automodel's
``parallelize_model`` over a CPU device mesh, as its recipes do: at world size 1 Automodel
leaves the module unsharded, at world size 2 it applies FSDP2 per decoder layer and at the root.
"""

from __future__ import annotations

import torch
from torch import nn

from refitkit.engines.automodel import AutomodelAdapter
from refitkit.offload.device import local_tensor
from tests.helpers.bits import bits_equal

VOCAB = 101  # odd sizes so world size 2 shards carry padding
SEQ = 12


def tiny_llama() -> nn.Module:
    """A 2-layer Llama (GQA, untied head) with HF's own module names."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=88,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def build(
    world_size: int, *, mixed_precision: bool = False, activation_checkpointing: bool = False, seed: int = 0
) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    """Automodel's trainer state for the tiny Llama: ``model_parts`` and its optimizer list."""
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh import MeshContext, ParallelismSizes
    from nemo_automodel.components.distributed.model_parallelizer import parallelize_model
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(seed)
    model = tiny_llama()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    mesh_context = MeshContext.build(
        FSDP2Config(mp_policy=policy),
        ParallelismSizes(),
        world_size=world_size,
        activation_checkpointing=activation_checkpointing,
    )
    model = parallelize_model(model, mesh_context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return [model], [optimizer]


def train_step(
    parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], rank: int, step: int, *, zero: bool = True
) -> float:
    """One causal-LM step on a batch that depends on (rank, step) only."""
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1000 * rank + step))
    loss = parts[0](input_ids=tokens, labels=tokens).loss
    loss.backward()
    for optimizer in optimizers:
        optimizer.step()
        if zero:
            optimizer.zero_grad()
    return loss.item()


def local_state(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    """Clones of every local shard, buffer and optimizer state tensor, for bit-exact comparison."""
    out: dict[str, torch.Tensor] = {}
    for index, part in enumerate(parts):
        out.update({f"p{index}.{n}": local_tensor(t).detach().clone() for n, t in part.named_parameters()})
        out.update({f"b{index}.{n}": t.detach().clone() for n, t in part.named_buffers()})
    for opt_index, optimizer in enumerate(optimizers):
        for index, state in enumerate(optimizer.state.values()):
            for key, value in state.items():
                out[f"o{opt_index}.{index}.{key}"] = local_tensor(value).detach().clone()
    return out


def _live(adapter: AutomodelAdapter) -> list[str]:
    named = adapter._model_tensors() + adapter._optimizer_tensors()
    return [name for name, tensor in named if local_tensor(tensor).untyped_storage().nbytes() > 0]


def train_with_cycle(rank: int, world_size: int, mixed_precision: bool, use_to: bool, keep_grads: bool) -> dict:
    """Baseline: 4 steps. Cycled: 2 steps, offload (checked), reload (checked), 2 steps. Same process."""
    base_parts, base_opts = build(world_size, mixed_precision=mixed_precision)
    # kept grads must match a baseline that never zeroed them (the step-3 backward adds to them)
    base_losses = [train_step(base_parts, base_opts, rank, s, zero=not (keep_grads and s == 1)) for s in range(4)]

    parts, optimizers = build(world_size, mixed_precision=mixed_precision)
    losses = [train_step(parts, optimizers, rank, s, zero=s != 1) for s in range(2)]
    adapter = AutomodelAdapter(parts, optimizers, keep_grads=keep_grads)
    params = dict(parts[0].named_parameters())
    before = local_state(parts, optimizers)
    grads_before = {n: local_tensor(p.grad).clone() for n, p in params.items() if p.grad is not None}

    move = adapter.to("cpu") if use_to else adapter.offload()
    sizes = adapter.state_bytes()
    offloaded = {
        "state": adapter.state.name,
        "sharded": any(type(p).__name__ == "DTensor" for p in params.values()),
        "live_storages": _live(adapter),
        "grads_left": [
            n for n, p in params.items() if p.grad is not None and local_tensor(p.grad).untyped_storage().nbytes()
        ],
        "grads_none": all(p.grad is None for p in params.values()),
        "device_bytes": sizes.device_bytes,
        "host_bytes": sizes.host_bytes,
        "moved_bytes": move.total.bytes,
        "model_bytes": move.model.bytes,
        "optimizer_bytes": move.optimizer.bytes,
        "grad_bytes": move.grad.bytes,
    }
    again = adapter.to("cpu")
    adapter.reload()
    after = local_state(parts, optimizers)
    grads_after = {n: local_tensor(p.grad).clone() for n, p in params.items() if p.grad is not None}
    same_objects = all(a is b for a, b in zip(params.values(), parts[0].parameters()))
    losses += [train_step(parts, optimizers, rank, s) for s in range(2, 4)]
    base_final, final = local_state(base_parts, base_opts), local_state(parts, optimizers)
    return {
        "base_losses": base_losses,
        "losses": losses,
        "offloaded": offloaded,
        "again_bytes": again.total.bytes,
        "state_after_reload": adapter.state.name,
        "same_objects": same_objects,
        "intact": [k for k in before if k not in after or not bits_equal(before[k], after[k])],
        "n_state": len(before),
        "n_grads_before": len(grads_before),
        "grads_changed": [
            k for k in grads_before if k not in grads_after or not bits_equal(grads_before[k], grads_after[k])
        ],
        "final_differs": [k for k in base_final if k not in final or not bits_equal(base_final[k], final[k])],
        "n_final": len(base_final),
    }


def two_rank_checks(rank: int, world_size: int, cycles: int) -> dict:
    """named_weights() against torch's own full state dict, repeated offload/reload cycles, and
    the refusal of Automodel's ddp strategy (which needs two ranks to wrap anything).

    Built with activation checkpointing so Automodel's checkpoint wrappers are in the module
    tree: streamed names must still be Hugging Face's.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    parts, optimizers = build(world_size, activation_checkpointing=True)
    for step in range(2):
        train_step(parts, optimizers, rank, step)
    adapter = AutomodelAdapter(parts, optimizers)
    streamed: list[tuple[str, torch.Tensor]] = []
    types: set[str] = set()
    for name, tensor in adapter.named_weights():
        types.add(type(tensor).__name__)
        streamed.append((name, tensor.clone()))
    full = get_model_state_dict(parts[0], options=StateDictOptions(full_state_dict=True))
    hf_names = sorted(tiny_llama().state_dict())  # the names a checkpoint / vLLM expects
    module_names = [n for n, _ in parts[0].named_parameters()]

    sizes = []
    for cycle in range(cycles):
        move = adapter.offload()
        sizes.append((adapter.arena.nbytes, adapter.arena.chunks, adapter.arena.held_bytes, move.total.storages))
        adapter.reload()
        train_step(parts, optimizers, rank, 10 + cycle)
    return {
        "streamed_names": [n for n, _ in streamed],
        "full_names": sorted(full),
        "hf_names": hf_names,
        "wrapped_module_names": [n for n in module_names if "_checkpoint_wrapped_module" in n],
        "mismatch": [n for n, t in streamed if n not in full or not bits_equal(t, full[n].detach())],
        "types": sorted(types),
        "sharded": any(type(p).__name__ == "DTensor" for p in parts[0].parameters()),
        "sizes": sizes,
        "held_after": adapter.arena.held_bytes,
        "ddp_refusal": ddp_strategy_is_refused(),
    }


def ddp_strategy_is_refused() -> str:
    """Above one rank Automodel's ddp strategy wraps the model in DistributedDataParallel: refused."""
    from nemo_automodel.components.distributed.config import DDPConfig
    from nemo_automodel.components.distributed.mesh import MeshContext, ParallelismSizes
    from nemo_automodel.components.distributed.model_parallelizer import parallelize_model

    from refitkit.errors import InvalidInput

    model = parallelize_model(tiny_llama(), MeshContext.build(DDPConfig(), ParallelismSizes(), world_size=2))
    weight = local_tensor(next(model.parameters()))
    try:
        AutomodelAdapter([model])
    except InvalidInput as error:
        assert weight.untyped_storage().nbytes() > 0, "a refused adapter must not have moved anything"
        return str(error)
    return "accepted"
