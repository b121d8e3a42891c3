"""Rank functions for Automodel's own model classes streamed under HF names: a MoE and a dense one.

The MoE model is Automodel's ``Qwen3MoeForCausalLM`` (grouped experts) built from a tiny ``Qwen3MoeConfig`` (no hub
download) with its torch backends, parallelized by Automodel's ``parallelize_model`` over a CPU
mesh; ``named_weights()`` goes through the model's own ``Qwen3MoeStateDictAdapter``. The dense
one is Automodel's own ``LlamaForCausalLM``, which has no adapter (its FQNs are HF's). The
reference is `transformers`' Qwen3-MoE loading the streamed set the way it loads a checkpoint.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from tests.helpers.bits import bits_equal
from tests.helpers.streams import stream_twice

SEQ = 8


def tiny_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        tie_word_embeddings=False,
        dtype="float32",
        max_position_embeddings=64,
    )


def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        dtype="float32",
        max_position_embeddings=64,
    )


def _backend():
    from nemo_automodel.components.models.common import BackendConfig

    return BackendConfig(
        attn="sdpa",
        linear="torch",
        rms_norm="torch",
        rope="torch",
        rope_fusion=False,
        experts="torch",
        dispatcher="torch",
    )


def _randomize(model: nn.Module) -> None:
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.05)


def automodel_llama(config) -> nn.Module:
    """Automodel's own dense Llama (not transformers' class) on CPU with its torch backends."""
    from nemo_automodel.components.models.llama.model import LlamaForCausalLM

    model = LlamaForCausalLM(config, backend=_backend())
    _randomize(model)
    return model


def automodel_moe(config) -> nn.Module:
    """Automodel's Qwen3-MoE on CPU with its torch backends.

    CPU shim (test only): nemo-automodel 0.7.0 builds the rotary cache with
    ``device=cuda:{torch.cuda.current_device()}``; current_device answers 0 while the model is
    built and the cache is pointed at the CPU afterwards.
    """
    from nemo_automodel.components.models.qwen3_moe.model import Qwen3MoeForCausalLM

    backend = _backend()
    real_current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0
    try:
        model = Qwen3MoeForCausalLM(config, backend=backend)
    finally:
        torch.cuda.current_device = real_current_device
    model.model.rotary_emb.device = torch.device("cpu")
    _randomize(model)
    return model


def hf_names_match_transformers(rank: int, world_size: int, tmp: str, kind: str, ep: int = 1) -> dict:
    """Stream through AutomodelAdapter, load into transformers from a checkpoint of the stream, compare.

    ``ep``: expert parallelism (Automodel's MoE parallelizer: experts ``Shard(0)`` over the ``ep`` mesh, tokens
    dispatched over gloo), FSDP2 over the rest.
    """
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh import MeshContext, ParallelismSizes
    from nemo_automodel.components.distributed.model_parallelizer import parallelize_model
    from safetensors.torch import load_file, save_file
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import DTensor
    from transformers import LlamaForCausalLM, Qwen3MoeForCausalLM

    from refitkit.engines.automodel import AutomodelAdapter

    config = tiny_config() if kind == "moe" else tiny_llama_config()
    model = automodel_moe(config) if kind == "moe" else automodel_llama(config)
    reference_cls = Qwen3MoeForCausalLM if kind == "moe" else LlamaForCausalLM
    # fp32 compute, so the forward compares with transformers' without bf16 rounding
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    mesh_context = MeshContext.build(FSDP2Config(mp_policy=policy), ParallelismSizes(ep_size=ep), world_size=world_size)
    model = parallelize_model(model, mesh_context)
    adapter = AutomodelAdapter([model])
    streamed, cycles = stream_twice(adapter)
    tokens = torch.randint(0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        native_logits = model(tokens)
        native_logits = getattr(native_logits, "logits", native_logits)
        if isinstance(native_logits, DTensor):
            native_logits = native_logits.full_tensor()
    # transformers loads the streamed set as the checkpoint it is (per-expert names), then saves it back
    checkpoint = os.path.join(tmp, f"rank{rank}")
    os.makedirs(checkpoint, exist_ok=True)
    save_file(
        {name: tensor.contiguous() for name, tensor in streamed.items()}, os.path.join(checkpoint, "model.safetensors")
    )
    config.save_pretrained(checkpoint)
    reference, info = reference_cls.from_pretrained(checkpoint, dtype=torch.float32, output_loading_info=True)
    reference.eval()
    with torch.no_grad():
        hf_logits = reference(tokens).logits
    # transformers writes from rank 0 only when torch.distributed is up: the sending rank
    resaved = {}
    if rank == 0:
        saved = os.path.join(tmp, "saved")
        reference.save_pretrained(saved)
        for file in sorted(os.listdir(saved)):
            if file.endswith(".safetensors"):
                resaved.update(load_file(os.path.join(saved, file)))
    placements = sorted({str(p.placements) for p in model.parameters() if isinstance(p, DTensor)})
    return {
        "streamed": sorted(streamed),
        "resaved": sorted(resaved),
        "missing": sorted(info["missing_keys"]),
        "unexpected": sorted(info["unexpected_keys"]),
        "mismatched": [str(m) for m in info.get("mismatched_keys", [])],
        "equal": {n: n in resaved and bits_equal(t, resaved[n]) for n, t in streamed.items()} if rank == 0 else {},
        "experts": sum(".mlp.experts." in n for n in streamed),
        "max_logit_diff": (native_logits.float() - hf_logits.float()).abs().max().item(),
        "logit_scale": hf_logits.abs().max().item(),
        "cyclic": (cycles.cyclic_objects, dict(cycles.by_type)),
        "placements": placements,
        "expert_placements": sorted(
            {
                f"{[getattr(d, 'value', d) for d in p.device_mesh.mesh_dim_names]}{p.placements}"
                for n, p in model.named_parameters()
                if isinstance(p, DTensor) and ".experts." in n
            }
        ),
        "has_converter": adapter._to_hf is not None,
    }
