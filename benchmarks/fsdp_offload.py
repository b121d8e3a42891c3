"""Offload / reload GB/s of a Qwen3-0.6B-shaped FSDP2 model with AdamW states, vs flat pinned memcpy.

Both figures are measured in the same run on the same device, so the ratio is meaningful; the
target is offload and reload >= 0.95x the flat pinned rate. No downloads: the model is built
from Qwen3-0.6B's config shapes. Run on a GPU machine:

    python benchmarks/fsdp_offload.py                # full size, cuda
    python benchmarks/fsdp_offload.py --layers 2 --device cpu --rounds 2   # quick smoke on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Qwen3Shape:
    """Qwen3-0.6B's published config shapes (tied embeddings)."""

    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_layers: int = 28
    num_heads: int = 16
    num_kv_heads: int = 8
    head_dim: int = 128


class Layer(nn.Module):
    """One decoder layer's parameters (attention with q/k norms, SwiGLU MLP, two RMSNorms)."""

    def __init__(self, s: Qwen3Shape) -> None:
        super().__init__()
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)
        self.q_norm = nn.RMSNorm(s.head_dim)
        self.k_norm = nn.RMSNorm(s.head_dim)
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)
        self.input_layernorm = nn.RMSNorm(s.hidden_size)
        self.post_attention_layernorm = nn.RMSNorm(s.hidden_size)


class Qwen3Params(nn.Module):
    """Qwen3-0.6B's parameter set; offload only needs the tensors, not a forward."""

    def __init__(self, s: Qwen3Shape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(Layer(s) for _ in range(s.num_layers))
        self.norm = nn.RMSNorm(s.hidden_size)


def build(shape: Qwen3Shape, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """FSDP2-sharded model (world size 1) whose AdamW has taken one step, so its states exist."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device(device):
        model = Qwen3Params(shape)
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def flat_memcpy_gbps(nbytes: int, device: torch.device, rounds: int) -> tuple[float, float]:
    """Best D2H and H2D GB/s of one flat buffer of ``nbytes`` into / out of pinned host memory."""
    pinned = device.type == "cuda"
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    d2h = h2d = 0.0
    for _ in range(rounds):
        _sync(device)
        start = time.perf_counter()
        host.copy_(source, non_blocking=True)
        _sync(device)
        d2h = max(d2h, nbytes / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        source.copy_(host, non_blocking=True)
        _sync(device)
        h2d = max(h2d, nbytes / (time.perf_counter() - start) / 1e9)
    del source, host
    return d2h, h2d


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=Qwen3Shape.num_layers, help="decoder layers (Qwen3-0.6B: 28)")
    parser.add_argument(
        "--vocab-size", type=int, default=Qwen3Shape.vocab_size, help="embedding rows (Qwen3-0.6B: 151936)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="steady offload/reload rounds after the first")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    args = parser.parse_args()

    from refitkit.engines.fsdp import FSDPAdapter
    from refitkit.offload import flush_device

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    with tempfile.TemporaryDirectory() as tmp:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            model, optimizer = build(Qwen3Shape(num_layers=args.layers, vocab_size=args.vocab_size), device)
            adapter = FSDPAdapter(model, optimizer)
            first_offload = adapter.offload()
            first_reload = adapter.reload()
            offloads, reloads = [], []
            for _ in range(args.rounds):
                offloads.append(adapter.offload().total)
                flush_device(device)
                reloads.append(adapter.reload().total)
            nbytes = first_offload.total.bytes
            flat_d2h, flat_h2d = flat_memcpy_gbps(nbytes, device, rounds=max(3, args.rounds))
        finally:
            dist.destroy_process_group()

    best_offload = max(m.gbps for m in offloads)
    best_reload = max(m.gbps for m in reloads)
    row = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "layers": args.layers,
        "vocab_size": args.vocab_size,
        "state_bytes": nbytes,
        "storages": first_offload.total.storages,
        "pinned": adapter.arena.pinned,
        "host_bytes": adapter.arena.nbytes,
        "first_offload_gbps": first_offload.total.gbps,
        "first_reload_gbps": first_reload.total.gbps,
        "offload_gbps": best_offload,
        "reload_gbps": best_reload,
        "offload_ms": min(m.seconds for m in offloads) * 1e3,
        "reload_ms": min(m.seconds for m in reloads) * 1e3,
        "flat_d2h_gbps": flat_d2h,
        "flat_h2d_gbps": flat_h2d,
        "offload_vs_flat": best_offload / flat_d2h if flat_d2h else 0.0,
        "reload_vs_flat": best_reload / flat_h2d if flat_h2d else 0.0,
        "host_footprint_ratio": adapter.arena.nbytes / nbytes if nbytes else 0.0,
    }
    if args.json:
        print(json.dumps(row))
        return
    for key, value in row.items():
        print(f"{key:>22}  {value:.3f}" if isinstance(value, float) else f"{key:>22}  {value}")
    print(f"{'targets':>22}  offload/reload >= 0.95x flat, host footprint <= 1.02x")


if __name__ == "__main__":
    main()
