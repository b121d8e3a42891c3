"""Megatron offload / reload on one GPU: memory freed by each function and GB/s vs a flat pinned memcpy.

Run on the GPU machine from the repo root (megatron-core on the path, no shim):
    python benchmarks/megatron_offload.py --hidden-size 2048 --num-layers 8 --rounds 3 [--json out.json]
Every ratio is against the flat pinned memcpy of the same bytes measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.limits import measure_copy_limits  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _timed(label: str, call, rows: list[dict]) -> None:
    torch.cuda.synchronize()
    allocated_before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    stats = call()
    wall_s = time.perf_counter() - start
    rows.append(
        {
            "call": label,
            "bytes": stats.bytes,
            "copy_s": stats.seconds,
            "wall_s": wall_s,
            "gbps": stats.gbps,
            "allocated_before": allocated_before,
            "allocated_after": torch.cuda.memory_allocated(),
            "reserved_after": torch.cuda.memory_reserved(),
        }
    )


def run(hidden_size: int, num_layers: int, rounds: int) -> dict:
    """Build a GPT with DDP + distributed Adam, train a step, then time ``rounds`` offload/reload rounds."""
    from refitkit.engines import megatron as rm
    from tests.engines.megatron import tiny_gpt

    trainer = tiny_gpt.build(hidden_size=hidden_size, num_layers=num_layers, vocab_size=32_000)
    tiny_gpt.train_step(trainer, 0)
    rows: list[dict] = []
    for round_index in range(rounds):
        _timed(
            f"r{round_index} offload_megatron_model_to_cpu",
            lambda: rm.offload_megatron_model_to_cpu(trainer.chunks),
            rows,
        )
        _timed(
            f"r{round_index} offload_megatron_optimizer", lambda: rm.offload_megatron_optimizer(trainer.optimizer), rows
        )
        _timed(
            f"r{round_index} load_megatron_model_to_gpu", lambda: rm.load_megatron_model_to_gpu(trainer.chunks), rows
        )
        _timed(f"r{round_index} load_megatron_optimizer", lambda: rm.load_megatron_optimizer(trainer.optimizer), rows)
        tiny_gpt.train_step(trainer, round_index + 1)
    # the copy-params pair alone, once, for its own figures
    _timed("offload_megatron_copy_params", lambda: rm.offload_megatron_copy_params(trainer.optimizer), rows)
    _timed("load_megatron_copy_params", lambda: rm.load_megatron_copy_params(trainer.optimizer), rows)
    moved = max(row["bytes"] for row in rows)
    limits = measure_copy_limits(moved, repeats=5)
    d2h, h2d = limits.pinned_d2h_gbps, limits.pinned_h2d_gbps
    steady = [row for row in rows if not row["call"].startswith("r0 ") and row["call"].startswith("r")]
    offload_bytes = sum(r["bytes"] for r in steady if "offload" in r["call"])
    offload_s = sum(r["copy_s"] for r in steady if "offload" in r["call"])
    reload_bytes = sum(r["bytes"] for r in steady if "load_" in r["call"] and "offload" not in r["call"])
    reload_s = sum(r["copy_s"] for r in steady if "load_" in r["call"] and "offload" not in r["call"])
    summary = {
        "megatron_core": __import__("megatron.core", fromlist=["__version__"]).__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "flat_pinned_d2h_gbps": d2h,
        "flat_pinned_h2d_gbps": h2d,
        "steady_offload_gbps": offload_bytes / offload_s / 1e9 if offload_s else 0.0,
        "steady_reload_gbps": reload_bytes / reload_s / 1e9 if reload_s else 0.0,
        "arena_host_bytes": rm.arena_of(trainer.chunks[0]).nbytes
        + rm.arena_of(trainer.optimizer.chained_optimizers[0]).nbytes,
    }
    summary["offload_vs_flat"] = summary["steady_offload_gbps"] / d2h
    summary["reload_vs_flat"] = summary["steady_reload_gbps"] / h2d
    return {"rows": rows, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/megatron_offload.py needs a CUDA GPU")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    try:
        result = run(args.hidden_size, args.num_layers, args.rounds)
    finally:
        torch.distributed.destroy_process_group()
    mib = 1 << 20
    print(f"{'call':40s} {'MiB':>9s} {'copy ms':>9s} {'wall ms':>9s} {'GB/s':>7s} {'alloc before→after MiB':>26s}")
    for row in result["rows"]:
        print(
            f"{row['call']:40s} {row['bytes'] / mib:9.1f} {row['copy_s'] * 1e3:9.2f} {row['wall_s'] * 1e3:9.2f} "
            f"{row['gbps']:7.1f} {row['allocated_before'] / mib:12.1f} → {row['allocated_after'] / mib:9.1f}"
        )
    for key, value in result["summary"].items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
