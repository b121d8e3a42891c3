"""Rank functions for TorchTitan's HF-named streaming: torchtitan debug models against `transformers` models."""

from __future__ import annotations

import torch
from torch import nn

from tests.engines.torchtitan.ranks import _force_sum_reduction, _use_cpu, meta_model, parallelize_on_cpu
from tests.helpers.bits import bits_equal
from tests.helpers.streams import stream_twice

SEQ_LEN = 16


def _trainer_config(flavour: str):
    if flavour == "llama3":
        from torchtitan.models.llama3.config_registry import llama3_debugmodel_ce_loss

        return llama3_debugmodel_ce_loss()
    from torchtitan.models.qwen3.config_registry import qwen3_debugmodel

    return qwen3_debugmodel()


def build(flavour: str, world_size: int, *, tp: int, n_layers: int = 2, seed: int = 0) -> tuple[nn.Module, object]:
    """torchtitan's debug model parallelized the way its trainer does it (FSDP2 over the rest of the world).

    CPU adjustments as in ranks.build: device_type "cpu", partial_dtensor backend, causal SDPA
    instead of flex attention, plain sum reduction for FSDP comms on gloo.
    """
    _use_cpu()
    config = _trainer_config(flavour)
    config.parallelism.spmd_backend = "partial_dtensor"
    config.parallelism.tensor_parallel_degree = tp
    config.parallelism.data_parallel_shard_degree = world_size // tp
    config.training.seq_len = SEQ_LEN
    config.training.local_batch_size = 2
    config.training.mixed_precision_param = "float32"  # compare logits without bf16 rounding
    config.activation_checkpoint = None
    config.compile.enable = False
    model, model_config, parallel_dims = meta_model(config, world_size, n_layers=n_layers)
    model = parallelize_on_cpu(config, model, parallel_dims, seed=seed)
    with torch.no_grad():  # non-trivial norms, so a swapped norm weight would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.mul_(1.5)
    sd_adapter = config.model_spec.state_dict_adapter(model_config, None)
    return model, sd_adapter, model_config


def hf_model(flavour: str, model_config) -> nn.Module:
    """The `transformers` model equivalent to torchtitan's config (fp32, eager attention)."""
    attention = model_config.layers[0].attention
    qkv = attention.qkv_linear
    common = dict(
        vocab_size=model_config.vocab_size,
        hidden_size=model_config.dim,
        intermediate_size=model_config.layers[0].feed_forward.w1.out_features,
        num_hidden_layers=len(model_config.layers),
        num_attention_heads=qkv.n_heads,
        num_key_value_heads=qkv.n_kv_heads,
        head_dim=qkv.head_dim,
        rms_norm_eps=model_config.norm.eps,
        tie_word_embeddings=model_config.enable_weight_tying,
        attention_bias=False,
        max_position_embeddings=model_config.max_seq_len,
    )
    rope = attention.rope
    if flavour == "llama3":
        from transformers import LlamaConfig, LlamaForCausalLM

        parameters = {
            "rope_type": "llama3",
            "rope_theta": float(rope.theta),
            "factor": float(rope.scaling_factor),
            "low_freq_factor": float(rope.low_freq_factor),
            "high_freq_factor": float(rope.high_freq_factor),
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        }
        config = LlamaConfig(**common, mlp_bias=False, rope_parameters=parameters)
        cls = LlamaForCausalLM
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        config = Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": float(rope.theta)})
        cls = Qwen3ForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(123)
    return cls(config).eval()


def hf_names_match_transformers(rank: int, world_size: int, flavour: str, tp: int) -> dict:
    """Stream HF-named weights, load them into a `transformers` model, compare state dicts and logits."""
    from torch.distributed.tensor import DTensor

    from refitkit.engines.torchtitan import TorchTitanAdapter

    model, sd_adapter, model_config = build(flavour, world_size, tp=tp)
    adapter = TorchTitanAdapter([model], state_dict_adapter=sd_adapter)
    streamed, cycles = stream_twice(adapter)
    reference = hf_model(flavour, model_config)
    result = reference.load_state_dict(streamed, strict=False)
    hf_state = reference.state_dict()
    tokens = torch.randint(0, model_config.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        titan_logits = model(tokens)
        if isinstance(titan_logits, DTensor):
            titan_logits = titan_logits.full_tensor()
        hf_logits = reference(tokens).logits
    placements = sorted({str(p.placements) for p in model.parameters() if isinstance(p, DTensor)})
    return {
        "streamed": sorted(streamed),
        "hf_names": sorted(hf_state),
        "missing": sorted(result.missing_keys),
        "unexpected": sorted(result.unexpected_keys),
        "equal": {
            n: tuple(t.shape) == tuple(hf_state[n].shape) and bits_equal(t, hf_state[n])
            for n, t in streamed.items()
            if n in hf_state
        },
        "tied": reference.lm_head.weight.data_ptr() == reference.model.embed_tokens.weight.data_ptr(),
        "max_logit_diff": (titan_logits.float() - hf_logits.float()).abs().max().item(),
        "logit_scale": hf_logits.abs().max().item(),
        "cyclic": (cycles.cyclic_objects, dict(cycles.by_type)),
        "placements": placements,
    }


def build_pipeline(flavour: str, world_size: int, *, pp: int, n_layers: int = 2, seed: int = 0):
    """torchtitan's debug model split by its own ``pipeline_llm``: one layer a stage, so with
    ``Interleaved1F1B`` each pipeline rank holds several stages; the rest of the world is FSDP2."""

    _use_cpu()
    config = _trainer_config(flavour)
    config.parallelism.spmd_backend = "partial_dtensor"
    config.parallelism.pipeline_parallel_degree = pp
    config.parallelism.data_parallel_shard_degree = world_size // pp
    config.parallelism.pipeline_parallel_schedule = "Interleaved1F1B"
    config.parallelism.pipeline_parallel_layers_per_stage = 1
    config.training.seq_len = SEQ_LEN
    config.training.local_batch_size = 2 * pp
    config.training.mixed_precision_param = "float32"
    config.activation_checkpoint = None
    config.compile.enable = False
    model, model_config, parallel_dims = meta_model(config, world_size, n_layers=n_layers)
    loss_fn = config.loss.build(compile_config=config.compile)
    _, model_parts, _, _ = config.model_spec.pipelining_fn(
        model,
        parallel_dims=parallel_dims,
        training=config.training,
        parallelism=config.parallelism,
        compile_config=config.compile,
        ac_config=None,
        dump_folder="/tmp",
        device=torch.device("cpu"),
        model_config=model_config,
        parallelize_fn=config.model_spec.parallelize_fn,
        loss_fn=loss_fn,
    )
    torch.manual_seed(seed + torch.distributed.get_rank())
    for part in model_parts:
        _force_sum_reduction(part)
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights(buffer_device=None)
    sd_adapter = config.model_spec.state_dict_adapter(model_config, None)
    pp_group = parallel_dims.get_mesh("pp").get_group()
    return model_parts, sd_adapter, model_config, pp_group


def pipeline_stages_reach_every_rank(rank: int, world_size: int, flavour: str, pp: int) -> dict:
    """Every pipeline rank streams the whole model under HF names; owners check their stages' bits."""
    import hashlib

    from refitkit.engines.torchtitan import TorchTitanAdapter
    from refitkit.watchdog import CycleAudit

    model_parts, sd_adapter, model_config, pp_group = build_pipeline(flavour, world_size, pp=pp)
    # the reference for this rank's own stages: torchtitan's state dict, gathered, through to_hf
    own = {}
    for part in model_parts:
        full = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in part.state_dict().items()}
        own.update(sd_adapter.to_hf(full))
    adapter = TorchTitanAdapter(model_parts, state_dict_adapter=sd_adapter, pp_group=pp_group)
    digests, own_equal, order = {}, {}, []
    for name, tensor in adapter.named_weights():
        if name in digests:
            raise AssertionError(f"{name} streamed twice")
        order.append(name)
        digests[name] = (
            tuple(tensor.shape),
            str(tensor.dtype),
            hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy()).hexdigest(),
        )
        if name in own:
            own_equal[name] = bits_equal(tensor, own[name])
    with CycleAudit() as audit:
        for _ in adapter.named_weights():
            pass
    reference = hf_model(flavour, model_config)
    hf_shapes = {n: tuple(t.shape) for n, t in reference.state_dict().items()}
    return {
        "stages": len(model_parts),
        "own": sorted(own),
        "own_equal": own_equal,
        "digests": digests,
        "order": order,
        "hf_shapes": hf_shapes,
        "tied": model_config.enable_weight_tying,
        "cyclic": (audit.report.cyclic_objects, dict(audit.report.by_type)),
    }


# --- Mixture-of-Experts: torchtitan's Qwen3-MoE (GroupedExperts w1_EFD / w2_EDF / w3_EFD) ---------------------

MOE = dict(vocab=256, dim=64, n_heads=4, n_kv_heads=2, head_dim=16, expert_dim=32, experts=8, top_k=2, theta=1e6)


def tiny_moe_config(n_layers: int = 2):
    """torchtitan's Qwen3-MoE model config at test size, made by its own layer builder (the debugmodel_moe recipe)."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        Qwen3Model,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )

    m = MOE
    return Qwen3Model.Config(
        vocab_size=m["vocab"],
        dim=m["dim"],
        norm=_qwen3_norm(m["dim"]),
        tok_embeddings=Embedding.Config(num_embeddings=m["vocab"], embedding_dim=m["dim"], param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=m["dim"], out_features=m["vocab"], param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            fuse_qkv=True,
            n_layers=n_layers,
            dim=m["dim"],
            n_heads=m["n_heads"],
            n_kv_heads=m["n_kv_heads"],
            head_dim=m["head_dim"],
            moe_hidden_dim=m["expert_dim"],
            num_experts=m["experts"],
            top_k=m["top_k"],
            attn_backend="flex",  # swapped for causal SDPA by meta_model
            rope=CosSinRoPE.Config(dim=m["head_dim"], max_seq_len=64, theta=m["theta"]),
            moe_comm_backend="standard",
        ),
    )


def hf_moe_config(n_layers: int = 2):
    """The `transformers` Qwen3-MoE config equivalent to ``tiny_moe_config`` (every layer sparse, top-k renormalised)."""
    from transformers import Qwen3MoeConfig

    m = MOE
    return Qwen3MoeConfig(
        vocab_size=m["vocab"],
        hidden_size=m["dim"],
        intermediate_size=96,  # dense MLP width: unused, every layer is sparse
        moe_intermediate_size=m["expert_dim"],
        num_hidden_layers=n_layers,
        num_attention_heads=m["n_heads"],
        num_key_value_heads=m["n_kv_heads"],
        head_dim=m["head_dim"],
        num_experts=m["experts"],
        num_experts_per_tok=m["top_k"],
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": m["theta"]},
        dtype="float32",
    )


def build_moe(world_size: int, *, ep: int, tp: int = 1, seed: int = 0) -> tuple[nn.Module, object, object]:
    """torchtitan's Qwen3-MoE parallelized by its own parallelize_fn: FSDP2, expert parallelism ``ep`` (all-to-all
    token dispatch over gloo), tensor parallelism ``tp``; CPU adjustments as in ``build``."""
    from torch.distributed.tensor import DTensor
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    _use_cpu()
    config = qwen3_moe_debug()
    config.model_spec.model = tiny_moe_config()
    config.parallelism.spmd_backend = "partial_dtensor"
    config.parallelism.tensor_parallel_degree = tp
    config.parallelism.data_parallel_shard_degree = world_size // tp
    config.parallelism.expert_parallel_degree = ep
    config.training.seq_len = SEQ_LEN
    config.training.local_batch_size = 2
    config.training.mixed_precision_param = "float32"
    config.activation_checkpoint = None
    config.compile.enable = False
    model, model_config, parallel_dims = meta_model(config, world_size, n_layers=2)
    model = parallelize_on_cpu(config, model, parallel_dims, seed=seed)
    generator = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "experts" in name:  # every rank initialised the same local experts: make each expert its own
                local = param._local_tensor if isinstance(param, DTensor) else param
                local.add_(0.02 * torch.randn(local.shape, generator=generator))
            elif "norm" in name:
                param.mul_(1.5)
    sd_adapter = config.model_spec.state_dict_adapter(model_config, None)
    return model, sd_adapter, model_config


def moe_names_match_transformers(rank: int, world_size: int, ep: int, tp: int, tmp: str) -> dict:
    """Stream torchtitan's MoE under HF names; transformers loads the stream as a checkpoint and saves it back."""
    import os

    from safetensors.torch import load_file, save_file
    from torch.distributed.tensor import DTensor
    from transformers import Qwen3MoeForCausalLM

    from refitkit.engines.torchtitan import TorchTitanAdapter

    model, sd_adapter, model_config = build_moe(world_size, ep=ep, tp=tp)
    adapter = TorchTitanAdapter([model], state_dict_adapter=sd_adapter)
    # one pass holding what it yields, so no storage is reused: which expert tensors share one
    held = list(adapter.named_weights())
    storages = {name: tensor.untyped_storage().data_ptr() for name, tensor in held if ".mlp.experts." in name}
    contiguous = all(tensor.is_contiguous() for _, tensor in held)
    fused = {name for name, tensor in held if ".mlp.experts." in name and tensor._base is None}
    del held
    streamed, cycles = stream_twice(adapter)
    tokens = torch.randint(0, MOE["vocab"], (2, SEQ_LEN), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        titan_logits = model(tokens)
        if isinstance(titan_logits, DTensor):
            titan_logits = titan_logits.full_tensor()
    checkpoint = os.path.join(tmp, f"rank{rank}")
    os.makedirs(checkpoint, exist_ok=True)
    save_file({n: t.contiguous() for n, t in streamed.items()}, os.path.join(checkpoint, "model.safetensors"))
    hf_moe_config().save_pretrained(checkpoint)
    reference, info = Qwen3MoeForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, output_loading_info=True)
    reference.eval()
    with torch.no_grad():
        hf_logits = reference(tokens).logits
        # the control: two experts of layer 0 swapped must move the logits well past the tolerance
        experts = reference.model.layers[0].mlp.experts
        experts.gate_up_proj[[0, 1]] = experts.gate_up_proj[[1, 0]].clone()
        experts.down_proj[[0, 1]] = experts.down_proj[[1, 0]].clone()
        swapped_logits = reference(tokens).logits
    resaved: dict[str, torch.Tensor] = {}
    if rank == 0:  # transformers writes from rank 0 only when torch.distributed is up
        reference, _ = Qwen3MoeForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, output_loading_info=True)
        saved = os.path.join(tmp, "saved")
        reference.save_pretrained(saved)
        for file in sorted(os.listdir(saved)):
            if file.endswith(".safetensors"):
                resaved.update(load_file(os.path.join(saved, file)))
    return {
        "streamed": sorted(streamed),
        "resaved": sorted(resaved),
        "equal": {n: n in resaved and bits_equal(t, resaved[n]) for n, t in streamed.items()} if rank == 0 else {},
        "missing": sorted(info["missing_keys"]),
        "unexpected": sorted(info["unexpected_keys"]),
        "mismatched": [str(m) for m in info.get("mismatched_keys", [])],
        "storages": storages,
        "contiguous": contiguous,
        "not_views": sorted(fused),
        "distinct_experts": all(
            not torch.equal(streamed[f"model.layers.{layer}.mlp.experts.{a}.{proj}.weight"], streamed[b_name])
            for layer in range(2)
            for proj in ("gate_proj", "up_proj", "down_proj")
            for a in range(MOE["experts"])
            for b_name in [f"model.layers.{layer}.mlp.experts.{b}.{proj}.weight" for b in range(a)]
        ),
        "max_logit_diff": (titan_logits.float() - hf_logits.float()).abs().max().item(),
        "swapped_logit_diff": (swapped_logits - hf_logits).abs().max().item(),
        "logit_scale": hf_logits.abs().max().item(),
        "cyclic": (cycles.cyclic_objects, dict(cycles.by_type)),
        "placements": sorted({str(p.placements) for p in model.parameters() if isinstance(p, DTensor)}),
    }
