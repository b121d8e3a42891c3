"""What a flush (``synchronize`` + ``empty_cache``) costs: by bytes returned, and by how many segments hold them.

The refit's flush returns everything the trainer freed to the driver, one ``cudaFree`` per allocator
segment. This times it for the same bytes in few large segments and in many small ones (a backward's
grads or an optimizer's temporaries: one segment per large tensor), and whether a flush waits for a D2H copy
still running on another stream (``--during-copy-gib``: the copy's size; 0 skips it).

    python benchmarks/flush_cost.py --gib 16,48 --segments 8,64,400
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def flush_ms(total_bytes: int, segments: int, rounds: int) -> list[float]:
    size = total_bytes // segments
    out = []
    for _ in range(rounds):
        tensors = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(segments)]
        torch.cuda.synchronize()
        del tensors
        start = time.perf_counter()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def flush_during_copy_ms(copy_bytes: int, free_bytes: int) -> dict:
    """A flush of ``free_bytes`` (idle, then while a D2H copy of ``copy_bytes`` runs on a side stream), and the copy."""
    source = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda")
    target = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    start = time.perf_counter()
    target.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    row = {"copy_gib": copy_bytes / 2**30, "copy_ms": round((time.perf_counter() - start) * 1e3, 1)}
    for label in ("idle", "during_copy"):
        block = torch.empty(free_bytes, dtype=torch.uint8, device="cuda")
        del block
        torch.cuda.synchronize()
        if label == "during_copy":
            with torch.cuda.stream(side):
                target.copy_(source, non_blocking=True)
        start = time.perf_counter()
        torch.cuda.empty_cache()
        row[f"flush_{label}_ms"] = round((time.perf_counter() - start) * 1e3, 1)
        side.synchronize()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", default="16,48")
    parser.add_argument("--segments", default="8,64,400")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--during-copy-gib", type=float, default=8.0)
    args = parser.parse_args()
    if args.during_copy_gib > 0:
        print(json.dumps(flush_during_copy_ms(int(args.during_copy_gib * 2**30), 1 << 30)), flush=True)
    for gib in (float(value) for value in args.gib.split(",")):
        for segments in (int(value) for value in args.segments.split(",")):
            times = flush_ms(int(gib * 2**30), segments, args.rounds)
            row = {
                "gib": gib,
                "segments": segments,
                "flush_ms": [round(t, 1) for t in times],
                "per_segment_ms": round(min(times) / segments, 3),
                "per_gib_ms": round(min(times) / gib, 2),
            }
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
