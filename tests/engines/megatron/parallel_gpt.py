"""A tiny Llama/Qwen3-like (dense or MoE) Megatron GPTModel at any TP/PP/VPP/EP layout, and its HF twin.

Runs inside a rank spawned by ``run_world``. The Megatron model uses the local layer spec (no
Transformer-Engine) with RMSNorm, SwiGLU, GQA, rope and no linear biases, so a ``transformers``
model of the same family and config computes the same function.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from tests.engines.megatron import cpu_shim, tiny_gpt

EXPERTS, TOPK = 4, 2
ROPE_THETA, EPS = 10000.0, 1e-6
INIT_STD = 0.1  # large enough that a misplaced row moves the logits far more than bf16 rounding


@dataclass(frozen=True)
class Layout:
    """One parallel layout: sizes, the model kind, the number of layers in the whole model."""

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int | None = None  # expert tensor parallelism; None: Megatron's default, the TP size
    moe: bool = False
    family: str = "qwen3"
    num_layers: int = 4
    tied: bool = False
    hidden: int = 64
    heads: int = 4
    groups: int = 2
    head_dim: int = 16
    ffn: int = 96
    moe_ffn: int = 32
    vocab: int = tiny_gpt.VOCAB
    shared_ffn: int | None = None  # Qwen2-MoE's gated shared expert
    grouped_gemm: bool = False  # experts as the legacy GroupedMLP (weight1 / weight2) instead of SequentialMLP


def build(layout: Layout, *, seed: int = 1234) -> list[torch.nn.Module]:
    """This rank's GPTModel chunks (one per virtual stage) for ``layout``, in bf16, norms made non-trivial."""
    cpu_shim.install()
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    if torch.cuda.is_available():
        torch.cuda.set_device(torch.distributed.get_rank() % torch.cuda.device_count())
    _tolerate_missing_transformer_engine()
    if layout.grouped_gemm:
        cpu_shim.install_grouped_gemm()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
        )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    moe = dict(
        num_moe_experts=EXPERTS,
        moe_ffn_hidden_size=layout.moe_ffn,
        moe_router_topk=TOPK,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=layout.grouped_gemm,
        # Qwen2-MoE: softmax over all experts, top-k weights not renormalised; Qwen3-MoE renormalises
        moe_router_pre_softmax=layout.family == "qwen2_moe",
        moe_shared_expert_intermediate_size=layout.shared_ffn,
        moe_shared_expert_gate=layout.shared_ffn is not None,
    )
    config = TransformerConfig(
        num_layers=layout.num_layers,
        hidden_size=layout.hidden,
        ffn_hidden_size=layout.ffn,
        num_attention_heads=layout.heads,
        num_query_groups=layout.groups,
        kv_channels=layout.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=EPS,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=layout.family.startswith("qwen2"),
        qk_layernorm=layout.family.startswith("qwen3"),
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        # on the GPU, initialise there (a 1 B model's CPU init dominated the GPU test's time); the CPU shim needs CPU init
        use_cpu_initialization=not torch.cuda.is_available(),
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        batch_p2p_comm=False,  # gloo has no batched isend/irecv
        init_method_std=INIT_STD,
        **(moe if layout.moe else {}),
    )
    spec = get_gpt_layer_local_spec(
        num_experts=EXPERTS if layout.moe else None,
        moe_grouped_gemm=layout.grouped_gemm,
        qk_layernorm=config.qk_layernorm,
        normalization="RMSNorm",
    )
    chunks = []
    for vp_stage in range(layout.vpp or 1):
        vp = vp_stage if layout.vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=layout.vocab,
            max_sequence_length=tiny_gpt.SEQ,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            parallel_output=False,
            share_embeddings_and_output_weights=layout.tied,
            position_embedding_type="rope",
            rotary_base=int(ROPE_THETA),
            vp_stage=vp,
        )
        _perturb_norms(model)
        _distinguish_experts(model)
        chunks.append(model.to(tiny_gpt.device()).to(torch.bfloat16))
    return chunks


def _tolerate_missing_transformer_engine() -> None:
    """megatron-core 0.16.1's router gemm reads ``te_general_gemm``, defined only when TE imports: define it as absent."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _perturb_norms(model: torch.nn.Module) -> None:
    """Norm weights start at ones, where a misplaced norm would go unseen: make each distinct, the same on every rank."""
    layers = [int(layer.layer_number) for layer in model.decoder.layers]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                continue
            parts = name.split(".")
            if name.startswith("decoder.layers."):
                parts[2] = str(layers[int(parts[2])])  # seeded by the global layer: ranks agree
            generator = torch.Generator().manual_seed(zlib.crc32(".".join(parts).encode()))
            param.copy_(1 + 0.2 * torch.randn(param.shape, generator=generator))


def _distinguish_experts(model: torch.nn.Module) -> None:
    """CPU init draws every expert-parallel rank's experts from one seed (expert 2 == expert 0 at EP=2).

    Negate the experts of odd expert-parallel ranks: other functions of the same magnitudes, so bf16
    rounding stays as small against the logits as before.
    """
    with torch.no_grad():
        for layer in model.decoder.layers:
            indices = getattr(layer.mlp, "local_expert_indices", None)
            if indices is None or (int(indices[0]) // len(indices)) % 2 == 0:
                continue
            experts = layer.mlp.experts
            params = experts.local_experts.parameters() if hasattr(experts, "local_experts") else experts.parameters()
            for param in params:
                param.neg_()


def forward_logits(chunks: list[torch.nn.Module], layout: Layout) -> torch.Tensor | None:
    """Megatron's logits for the fixed batch, run stage by stage with point-to-point sends.

    Returns the logits on the last pipeline stage's ranks, None elsewhere.
    """
    from megatron.core import parallel_state

    device = tiny_gpt.device()
    tokens, _ = tiny_gpt.batch(0, 0, vocab_size=layout.vocab)
    tokens = tokens.to(device)
    positions = torch.arange(tiny_gpt.SEQ, device=device).unsqueeze(0).expand(tiny_gpt.BATCH, -1)
    causal = torch.triu(torch.ones(tiny_gpt.SEQ, tiny_gpt.SEQ, dtype=torch.bool, device=device), diagonal=1)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    hidden_shape = (tiny_gpt.SEQ, tiny_gpt.BATCH, layout.hidden)
    output = None
    with torch.no_grad():
        for vp_stage, chunk in enumerate(chunks):
            chunk.eval()  # MoE with TP refuses to *train* without sequence parallelism; inference is fine
            first = stage == 0 and vp_stage == 0
            last = stage == layout.pp - 1 and vp_stage == len(chunks) - 1
            # hidden states cross stages through the CPU: the test worlds run on gloo
            if not first:
                hidden = torch.empty(hidden_shape, dtype=torch.bfloat16)
                torch.distributed.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
                chunk.set_input_tensor(hidden.to(device))
            output = chunk(tokens, positions, causal.view(1, 1, tiny_gpt.SEQ, tiny_gpt.SEQ))
            if not last:
                hidden = output.to("cpu").contiguous()
                torch.distributed.send(hidden, dst=parallel_state.get_pipeline_model_parallel_next_rank())
    is_last_stage = stage == layout.pp - 1
    return output.float().cpu() if is_last_stage else None


def hf_config(layout: Layout):
    """The ``transformers`` config of the same model."""
    import transformers

    common = dict(
        vocab_size=layout.vocab,
        hidden_size=layout.hidden,
        intermediate_size=layout.ffn,
        num_hidden_layers=layout.num_layers,
        num_attention_heads=layout.heads,
        num_key_value_heads=layout.groups,
        head_dim=layout.head_dim,
        rms_norm_eps=EPS,
        tie_word_embeddings=layout.tied,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        attention_bias=False,
    )
    if layout.family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            moe_intermediate_size=layout.moe_ffn,
            num_experts=EXPERTS,
            num_experts_per_tok=TOPK,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
    if layout.family == "qwen2_moe":
        common.pop("attention_bias"), common.pop("head_dim")
        return transformers.Qwen2MoeConfig(
            moe_intermediate_size=layout.moe_ffn,
            shared_expert_intermediate_size=layout.shared_ffn,
            num_experts=EXPERTS,
            num_experts_per_tok=TOPK,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            qkv_bias=True,
            **common,
        )
    if layout.family == "qwen3":
        return transformers.Qwen3Config(**common)
    if layout.family == "llama":
        return transformers.LlamaConfig(**common)
    if layout.family == "qwen2":
        common.pop("attention_bias"), common.pop("head_dim")  # Qwen2: q/k/v always biased, head_dim from sizes
        return transformers.Qwen2Config(**common)
    raise ValueError(f"no HF config for family {layout.family!r} in this test helper")


@dataclass
class Trainer:
    """DDP-wrapped chunks of one rank, their distributed Adam, and the layout."""

    chunks: list
    optimizer: object
    layout: Layout


MICROBATCHES = 4


def build_trainer(layout: Layout, *, seed: int = 1234) -> Trainer:
    """``build`` wrapped the way Megatron trainers wrap it: Float16Module, DDP per chunk, distributed Adam."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    chunks = build(layout, seed=seed)
    config = chunks[0].config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
    )
    wrapped = [
        DistributedDataParallel(config, ddp_config, Float16Module(config, chunk), disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-2, weight_decay=0.01, bf16=True, use_distributed_optimizer=True, clip_grad=1.0
        ),
        wrapped,
    )
    return Trainer(chunks=wrapped, optimizer=optimizer, layout=layout)


def _forward_step(data_iterator, model):
    device = tiny_gpt.device()
    tokens, labels = next(data_iterator)
    positions = torch.arange(tiny_gpt.SEQ, device=device).unsqueeze(0).expand(tiny_gpt.BATCH, -1)
    causal = torch.triu(torch.ones(tiny_gpt.SEQ, tiny_gpt.SEQ, dtype=torch.bool, device=device), diagonal=1)
    output = model(
        tokens.to(device), positions, causal.view(1, 1, tiny_gpt.SEQ, tiny_gpt.SEQ), labels=labels.to(device)
    )

    def loss_func(per_token: torch.Tensor):
        loss = per_token.float().mean()
        return loss, {"loss": loss.detach()}

    return output, loss_func


def train_step(trainer: Trainer, step: int) -> float:
    """One real Megatron step through its pipeline schedule; returns this rank's summed microbatch loss (0 off the last stage)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data_rank = parallel_state.get_data_parallel_rank()
    batches = [tiny_gpt.batch(100 * step + m, data_rank, vocab_size=trainer.layout.vocab) for m in range(MICROBATCHES)]
    iterators = [iter(batches) for _ in trainer.chunks]
    for chunk in trainer.chunks:
        chunk.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=trainer.chunks,
        num_microbatches=MICROBATCHES,
        seq_length=tiny_gpt.SEQ,
        micro_batch_size=tiny_gpt.BATCH,
        forward_only=False,
    )
    ok, _, _ = trainer.optimizer.step()
    if not ok:
        raise RuntimeError(f"optimizer step {step} was skipped")
    return float(sum(item["loss"].item() for item in losses))


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's params by (chunk, name), copied to the CPU: what bit-identity is checked on."""
    return {
        f"{index}/{name}": p.detach().to("cpu", copy=True)
        for index, chunk in enumerate(trainer.chunks)
        for name, p in chunk.named_parameters()
    }
