"""Rank function for the GPU test: an Automodel-parallelized Llama on one CUDA device (world size 1)."""

from __future__ import annotations

import os
import time

import torch
from torch import nn

from refitkit.engines.automodel import AutomodelAdapter
from refitkit.offload import flush_device
from tests.engines.automodel.ranks import local_state
from tests.helpers.bits import bits_equal

VOCAB = 32000


def _build(device: torch.device) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    from nemo_automodel.components.distributed.config import FSDP2Config
    from nemo_automodel.components.distributed.mesh import MeshContext, ParallelismSizes
    from nemo_automodel.components.distributed.model_parallelizer import parallelize_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attn_implementation="eager",  # deterministic backward, for the bit-exact comparison
    )
    model = LlamaForCausalLM(config).to(device)
    model = parallelize_model(model, MeshContext.build(FSDP2Config(), ParallelismSizes(), world_size=1))
    return [model], [torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)]


def _step(parts: list[nn.Module], optimizers: list[torch.optim.Optimizer], step: int) -> float:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (2, 128), generator=generator).to(parts[0].device)
    loss = parts[0](input_ids=tokens, labels=tokens).loss
    loss.backward()
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()
    return loss.item()


def _pinned_copy_gbps(nbytes: int, device: torch.device) -> tuple[float, float]:
    """The flat pinned memcpy rates (D2H, H2D) for ``nbytes``, measured now on this device."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    for dst, src in ((host, on_device), (on_device, host)):
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    del host, on_device
    return rates[0], rates[1]


def cuda_cycle(rank: int, world_size: int) -> dict:
    """Baseline 4 steps; cycled: 2 steps, offload + flush (memory checked), reload, 2 steps."""
    # cuBLAS needs a fixed workspace for deterministic GEMMs; set before CUDA starts in this rank
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    base_parts, base_opts = _build(device)
    base_losses = [_step(base_parts, base_opts, s) for s in range(4)]
    base_final = {k: v.cpu() for k, v in local_state(base_parts, base_opts).items()}
    del base_parts, base_opts

    parts, optimizers = _build(device)
    losses = [_step(parts, optimizers, s) for s in range(2)]
    adapter = AutomodelAdapter(parts, optimizers)
    adapter.arena.reserve(_storages(adapter))  # pin ahead, off the critical path
    flush_device(device)
    allocated_before, reserved_before = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    offload = adapter.offload()
    allocated_after = torch.cuda.memory_allocated(device)
    flush_device(device)
    reserved_after = torch.cuda.memory_reserved(device)
    reload = adapter.reload()
    losses += [_step(parts, optimizers, s) for s in range(2, 4)]
    final = {k: v.cpu() for k, v in local_state(parts, optimizers).items()}
    d2h, h2d = _pinned_copy_gbps(offload.total.bytes, device)
    return {
        "base_losses": base_losses,
        "losses": losses,
        "final_differs": [k for k in base_final if k not in final or not bits_equal(base_final[k], final[k])],
        "moved_bytes": offload.total.bytes,
        "storages": offload.total.storages,
        "allocated_drop": allocated_before - allocated_after,
        "reserved_drop": reserved_before - reserved_after,
        "pinned": adapter.arena.pinned,
        "offload_gbps": offload.total.gbps,
        "reload_gbps": reload.total.gbps,
        "pinned_d2h_gbps": d2h,
        "pinned_h2d_gbps": h2d,
    }


def _storages(adapter: AutomodelAdapter) -> list[torch.UntypedStorage]:
    from refitkit.offload.device import local_tensor

    return [local_tensor(t).untyped_storage() for _, t in adapter._model_tensors() + adapter._optimizer_tensors()]
