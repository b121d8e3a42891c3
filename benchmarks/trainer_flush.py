"""What the refit's flush returns after a real train step, by how the trainer allocates (no engine).

An ``FSDPAdapter`` over a Hugging Face Qwen3 model (Qwen3-0.6B or -8B shapes, random bf16 weights) and AdamW;
per variant, rounds of train step → offload → flush → reload, each timed, with the allocator's segments just
before the flush (each is one ``cudaFree`` there and one ``cudaMalloc`` in the next step). Variants: AdamW
``foreach`` (torch's default on CUDA: a param-sized temporary per param every step) or ``fused`` (none), and
``zero_grads`` (``FSDPAdapter(zero_grads=True)``: zero grads at reload, in shared segments, that the step
accumulates into) or not (the step's grads are new allocations, dropped at offload). The first round of each
variant pins the arena and is not steady. The flat pinned D2H of the state is measured in the same run.

    python benchmarks/trainer_flush.py --model 8b --variants foreach,fused,foreach+zero_grads,fused+zero_grads
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a source checkout

from benchmarks.colocated_loop import MODELS, PROMPTS, hf_model  # noqa: E402
from benchmarks.limits import measure_copy_limits  # noqa: E402

VARIANTS = ("foreach", "fused", "foreach+zero_grads", "fused+zero_grads")


def segments() -> int:
    return torch.cuda.memory_stats().get("segment.all.current", 0)


def run_variant(model: torch.nn.Module, variant: str, *, rounds: int, d2h_gbps: float) -> list[dict]:
    from refitkit.engines.fsdp import FSDPAdapter
    from refitkit.offload import flush_device

    fused = variant.split("+")[0] == "fused"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=not fused, fused=fused)
    adapter = FSDPAdapter(model, optimizer, zero_grads="zero_grads" in variant.split("+"))
    rows = []
    for index in range(rounds):
        batch = torch.tensor(PROMPTS[:2], device="cuda")
        start = time.perf_counter()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # grads stay: the offload drops them, like a real step's
        torch.cuda.synchronize()
        train_s = time.perf_counter() - start
        start = time.perf_counter()
        moved = adapter.offload().total.bytes
        offload_s = time.perf_counter() - start
        held = segments()
        start = time.perf_counter()
        flush_device()
        flush_s = time.perf_counter() - start
        rows.append(
            {
                "variant": variant,
                "round": index,
                "train_ms": round(train_s * 1e3, 1),
                "offload_ms": round(offload_s * 1e3, 1),
                "segments_at_flush": held,
                "flush_ms": round(flush_s * 1e3, 1),
                "state_gb": round(moved / 1e9, 2),
                "flat_d2h_ms": round(moved / (d2h_gbps * 1e9) * 1e3, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        adapter.reload()
    adapter.arena.release()  # the next variant pins its own
    optimizer.state.clear()
    for param in model.parameters():
        param.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="8b", choices=sorted(MODELS))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [variant for variant in variants if variant not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    limits = measure_copy_limits(1 << 30)
    model = hf_model(MODELS[args.model])
    rows = [
        row
        for variant in variants
        for row in run_variant(model, variant, rounds=args.rounds, d2h_gbps=limits.pinned_d2h_gbps)
    ]
    for variant in variants:
        steady = [row for row in rows if row["variant"] == variant and row["round"] > 0]
        print(
            f"{args.model} {variant}: flush {min(r['flush_ms'] for r in steady):.0f}–{max(r['flush_ms'] for r in steady):.0f} ms "
            f"({steady[0]['segments_at_flush']} segments), train step {min(r['train_ms'] for r in steady):.0f}–"
            f"{max(r['train_ms'] for r in steady):.0f} ms, offload {min(r['offload_ms'] for r in steady):.0f} ms against "
            f"{steady[0]['flat_d2h_ms']:.0f} ms flat D2H ({limits.pinned_d2h_gbps:.1f} GB/s)",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
