"""Offload/reload of Qwen3-shaped bf16 weights vs the flat pinned memcpy of the same bytes (GPU).

Run: python benchmarks/offload.py [--model Qwen3-8B] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.limits import measure_copy_limits  # noqa: E402
from benchmarks.shapes import CONFIGS, make_weights, total_bytes  # noqa: E402
from refitkit.offload import HostArena, flush_device, offload_tensors, reload_tensors  # noqa: E402


def pageable_baseline(weights: dict[str, torch.Tensor]) -> tuple[float, float]:
    """The naive peer path: `.to("cpu")` into fresh pageable memory, then back. Returns (d2h, h2d) GB/s."""
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    torch.cuda.synchronize()
    start = time.perf_counter()
    host = {k: v.to("cpu", non_blocking=True) for k, v in weights.items()}
    torch.cuda.synchronize()
    d2h = nbytes / (time.perf_counter() - start) / 1e9
    start = time.perf_counter()
    for k, v in weights.items():
        v.copy_(host[k], non_blocking=True)
    torch.cuda.synchronize()
    h2d = nbytes / (time.perf_counter() - start) / 1e9
    return d2h, h2d


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="Qwen3-8B", choices=sorted(CONFIGS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("offload benchmark needs CUDA; skipped")
        return {}
    config = CONFIGS[args.model]
    nbytes = total_bytes(config)
    limits = measure_copy_limits(nbytes)
    weights = make_weights(config, device="cuda")
    pageable_d2h, pageable_h2d = pageable_baseline(weights)
    flush_device()
    allocated_before = torch.cuda.memory_allocated()
    arena = HostArena()
    first_off = offload_tensors(weights, arena)
    allocated_offloaded = torch.cuda.memory_allocated()
    first_on = reload_tensors(weights, arena)
    footprint = arena.nbytes / nbytes
    offs, ons = [], []
    for _ in range(args.rounds):
        offs.append(offload_tensors(weights, arena).gbps)
        ons.append(reload_tensors(weights, arena).gbps)
    result = {
        "model": config.name,
        "bytes": nbytes,
        "tensors": len(weights),
        "pinned_d2h_gbps": limits.pinned_d2h_gbps,
        "pinned_h2d_gbps": limits.pinned_h2d_gbps,
        "d2d_gbps": limits.d2d_gbps,
        "pageable_to_cpu_gbps": pageable_d2h,
        "pageable_h2d_gbps": pageable_h2d,
        "first_offload_gbps": first_off.gbps,
        "first_reload_gbps": first_on.gbps,
        "steady_offload_gbps": statistics.median(offs),
        "steady_reload_gbps": statistics.median(ons),
        "offload_ratio": statistics.median(offs) / limits.pinned_d2h_gbps,
        "reload_ratio": statistics.median(ons) / limits.pinned_h2d_gbps,
        "host_footprint_ratio": footprint,
        "device_bytes_freed": allocated_before - allocated_offloaded,
    }
    print(f"{config.name}: {nbytes / 1e9:.2f} GB in {len(weights)} bf16 tensors")
    print(
        f"  limits (same run): pinned D2H {limits.pinned_d2h_gbps:.1f} GB/s, H2D {limits.pinned_h2d_gbps:.1f} GB/s, D2D {limits.d2d_gbps:.0f} GB/s"
    )
    print(f"  naive .to('cpu') pageable: D2H {pageable_d2h:.1f} GB/s, H2D {pageable_h2d:.1f} GB/s")
    print(f"  first round (arena alloc + pin): offload {first_off.gbps:.1f} GB/s, reload {first_on.gbps:.1f} GB/s")
    print(
        f"  steady ({args.rounds} rounds, median): offload {result['steady_offload_gbps']:.1f} GB/s "
        f"({result['offload_ratio']:.3f}x pinned D2H), reload {result['steady_reload_gbps']:.1f} GB/s "
        f"({result['reload_ratio']:.3f}x pinned H2D)"
    )
    print(
        f"  host footprint {footprint:.4f}x offloaded bytes; device bytes freed {result['device_bytes_freed'] / 1e9:.2f} GB"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
