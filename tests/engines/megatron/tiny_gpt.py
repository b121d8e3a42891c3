"""A tiny real Megatron GPT training setup for tests: local layer spec, bf16, DDP + distributed Adam.

Runs inside a rank spawned by ``run_world`` (torch.distributed already initialised). On a
CPU-only machine it installs the test-only ``cpu_shim`` first; on a GPU machine it runs as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.engines.megatron import cpu_shim

VOCAB = 128
SEQ = 16
BATCH = 2


@dataclass
class Trainer:
    """The pieces a Megatron RL trainer holds: model chunks, optimizer, a fixed device."""

    chunks: list
    optimizer: object
    device: torch.device


def device() -> torch.device:
    """The device a rank trains on: its GPU when there is one, else the CPU (through the shim)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build(
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    ffn_hidden_size: int | None = None,
    vocab_size: int = VOCAB,
    use_distributed_optimizer: bool = True,
    ddp: bool = True,
    bf16: bool = True,
    frozen: tuple[str, ...] = (),
    with_optimizer: bool = True,
    seed: int = 1234,
) -> Trainer:
    """A GPTModel (local spec) wrapped in Float16Module and DDP, with Megatron's Adam over it.

    ``frozen`` names GPT params to freeze before DDP wraps the model (like a LoRA base: they stay
    outside the DDP buffers and the optimizer).
    """
    cpu_shim.install()
    if torch.cuda.is_available():
        torch.cuda.set_device(torch.distributed.get_rank() % torch.cuda.device_count())
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        ffn_hidden_size=ffn_hidden_size or 4 * hidden_size,
        num_attention_heads=4,
        use_cpu_initialization=True,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=vocab_size,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
    )
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    missing = set(frozen) - {name for name, _ in model.named_parameters()}
    if missing:
        raise KeyError(f"no such GPT params to freeze: {sorted(missing)}")
    model.to(device())
    if bf16:
        model = Float16Module(config, model)
    if ddp:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=use_distributed_optimizer,
        )
        model = DistributedDataParallel(config, ddp_config, model)
    if not with_optimizer:
        return Trainer(chunks=[model], optimizer=None, device=device())
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            weight_decay=0.01,
            bf16=bf16,
            use_distributed_optimizer=use_distributed_optimizer and ddp,
            clip_grad=1.0,
        ),
        [model],
    )
    return Trainer(chunks=[model], optimizer=optimizer, device=device())


def batch(step: int, rank: int, *, vocab_size: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic tokens and labels for (step, rank): the same data in every run."""
    generator = torch.Generator().manual_seed(10_000 * step + rank)
    tokens = torch.randint(0, vocab_size, (BATCH, SEQ + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def forward_backward(trainer: Trainer, step: int) -> float:
    """Forward, backward and DDP grad sync of one step (grads ready in the grad buffers); returns the loss."""
    model = trainer.chunks[0]
    rank = torch.distributed.get_rank()
    tokens, labels = batch(step, rank)
    tokens, labels = tokens.to(trainer.device), labels.to(trainer.device)
    positions = torch.arange(SEQ, device=trainer.device).unsqueeze(0).expand(BATCH, -1)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device=trainer.device), diagonal=1)
    model.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    per_token = model(tokens, positions, causal.view(1, 1, SEQ, SEQ), labels=labels)
    loss = per_token.float().mean()
    loss.backward()
    model.finish_grad_sync()
    return loss.item()


def optimizer_step(trainer: Trainer, step: int) -> None:
    """The optimizer half of a step (grad clipping, Adam, param all-gather)."""
    ok, _, _ = trainer.optimizer.step()
    if not ok:
        raise RuntimeError(f"optimizer step {step} was skipped")


def train_step(trainer: Trainer, step: int) -> float:
    """One real Megatron step: forward, backward, DDP grad sync, optimizer step; returns the loss."""
    loss = forward_backward(trainer, step)
    optimizer_step(trainer, step)
    return loss


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    """Every model parameter, copied to the CPU, by name: what bit-identity is checked on."""
    return {name: p.detach().to("cpu", copy=True) for name, p in trainer.chunks[0].named_parameters()}


def logits(trainer: Trainer, step: int = 0) -> torch.Tensor:
    """The model's output logits for a fixed batch, on the CPU (forward only, no grad)."""
    model = trainer.chunks[0]
    tokens, _ = batch(step, torch.distributed.get_rank())
    tokens = tokens.to(trainer.device)
    positions = torch.arange(SEQ, device=trainer.device).unsqueeze(0).expand(BATCH, -1)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool, device=trainer.device), diagonal=1)
    with torch.no_grad():
        return model(tokens, positions, causal.view(1, 1, SEQ, SEQ)).float().cpu()


def device_bytes(tensors) -> int:
    """Device bytes held by the unique storages of ``tensors`` right now."""
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())
