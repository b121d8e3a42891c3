"""The whole refit cycle on one device, at the copy-engine limit: issue 14's table in one run.

An ``FSDPAdapter`` over a module with a Qwen3 checkpoint's weight shapes in bf16 and AdamW
state, ``RefitCycle`` streaming to a receiver process that copies each tensor into its own
params, a Python heap of ``--heap-objects`` objects in the trainer. Every mode runs on the same
model with a fresh arena (so its first round allocates and pins, unless ``prepare()`` did it
in the background while a train step ran) and then ``--rounds`` steady rounds:

- ``serial``: overlap and deferral off; ``overlap``: optimizer copies during the sync;
- ``overlap+prepare``: the arena pinned in the background during a train step;
- ``overlap+prepare+defer``: ``resume(defer_optimizer=True)`` as well (when this refitkit has it);
- ``overlap+prepare+pack``: ``adapter.pack_below_bytes = 4 MiB`` (small storages moved in runs).

Measured in the same run: the flat pinned D2H/H2D rates (``benchmarks/limits.py``) and a bare
``empty_cache`` of the same segments. Per round: sync, offload, flush, refit and resume times,
the next train step's time, GC collections by generation (``gc.callbacks``).

    python benchmarks/refit_cycle.py                           # GPU: Qwen3-8B then Qwen3-0.6B shapes
    python benchmarks/refit_cycle.py --models 0.6b --rounds 5
    python benchmarks/refit_cycle.py --preset tiny --device cpu --rounds 1 --json out.json   # CPU smoke
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import multiprocessing as mp
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a source checkout

from benchmarks.shapes import CONFIGS, QWEN3_0_6B, QWEN3_8B, DecoderConfig, weight_shapes  # noqa: E402

MODELS: dict[str, DecoderConfig] = {"8b": QWEN3_8B, "0.6b": QWEN3_0_6B, "tiny": CONFIGS["tiny"]}
PRESETS = {"full": ("8b", "0.6b"), "tiny": ("tiny",)}
TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Mode:
    name: str
    overlap: bool
    prepare: bool
    defer: bool
    pack_below: int = 0  # adapter.pack_below_bytes: runs of smaller storages move as one copy


MODES = (
    Mode("serial", overlap=False, prepare=False, defer=False),
    Mode("overlap", overlap=True, prepare=False, defer=False),
    Mode("overlap+prepare", overlap=True, prepare=True, defer=False),
    Mode("overlap+prepare+defer", overlap=True, prepare=True, defer=True),
    Mode("overlap+prepare+pack", overlap=True, prepare=True, defer=False, pack_below=4 << 20),
)


class ShapedWeights(nn.Module):
    """Parameters with a checkpoint's shapes (one storage each) and a loss that gives every one a full grad."""

    def __init__(self, config: DecoderConfig, device: torch.device) -> None:
        super().__init__()
        generator = torch.Generator(device=device).manual_seed(0)
        for name, shape in weight_shapes(config):
            weight = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16) * 0.02
            self.register_parameter(name.replace(".", "__"), nn.Parameter(weight))

    def loss(self) -> torch.Tensor:
        # d/dp of p*p is 2p: a dense grad per param; the product is freed by its sum, so the peak is one param
        return sum((p * p).sum() for p in self.parameters()) * 1e-3


def checksums(named: list[tuple[str, torch.Tensor]]) -> list[int]:
    return [int(torch.sum(t.view(torch.int16), dtype=torch.int64)) for _, t in named]


def receiver_main(endpoint: str, device: str, sessions: int, conn) -> None:
    """What an inference engine does with a sync: copy each tensor into its own params."""
    from refitkit.transfer import BucketedWeightReceiver

    params: dict[str, torch.Tensor] = {}
    receiver = BucketedWeightReceiver(endpoint, device, timeout_s=TIMEOUT_S)

    def load(batch, is_last):
        for name, tensor in batch:
            mine = params.get(name)
            if mine is None:  # allocated in the first session only, like an engine's params
                params[name] = mine = torch.empty_like(tensor)
            mine.copy_(tensor)

    conn.send("ready")
    for _ in range(sessions):
        receiver.receive(load)
        conn.send("received")
    if conn.poll(TIMEOUT_S):
        conn.recv()
        conn.send(checksums(sorted(params.items())))


class GcCounter:
    """Collections by generation while armed (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        gc.callbacks.append(self._count)

    def _count(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.counts[info["generation"]] += 1

    def take(self) -> list[int]:
        counts, self.counts = self.counts, [0, 0, 0]
        return counts

    def close(self) -> None:
        gc.callbacks.remove(self._count)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def bare_empty_cache_ms(sizes: list[int], device: torch.device) -> float:
    """What ``empty_cache`` alone costs for segments of these sizes: allocate, free to the cache, time it."""
    if device.type != "cuda":
        return 0.0
    blocks = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    del blocks
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return (time.perf_counter() - start) * 1e3


def bare_regrow_ms(sizes: list[int], device: torch.device) -> float:
    """What a reload's allocations alone cost: storages of these sizes from an emptied cache (cudaMalloc), no copies."""
    if device.type != "cuda":
        return 0.0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    start = time.perf_counter()
    blocks = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    del blocks
    torch.cuda.empty_cache()
    return elapsed * 1e3


def fresh_reload_floor_s(adapter, device: torch.device) -> float:
    """A reload with nothing of refitkit in it: memory just handed back to the driver, then each storage allocated
    and copied from its arena slot, largest first, one stream. The driver clears memory freed by a process before
    handing it out again, and copies into it right after a flush run below the flat rate while it does (measured
    on an H200: 50.6 GB/s against 55.2 for an 8B reload; 54.4 one second later): this is the floor of a reload
    that follows a flush, as in a colocated cycle, where the engine frees its KV cache just before ``resume()``."""
    from refitkit.offload import flush_device

    if device.type != "cuda":
        return 0.0
    adapter.offload()
    slots = sorted(
        (s for s in adapter.arena._slots.values() if s.holds_data and not s.expired()), key=lambda s: -s.nbytes
    )
    sources = [adapter.arena.host_bytes(slot, slot.nbytes) for slot in slots]
    flush_device(device)
    start = time.perf_counter()
    blocks = []
    for source in sources:
        block = torch.empty(source.numel(), dtype=torch.uint8, device=device)
        block.copy_(source, non_blocking=True)
        blocks.append(block)
    _sync(device)
    elapsed = time.perf_counter() - start
    del blocks, sources
    flush_device(device)
    adapter.reload()
    return elapsed


def _defer_supported() -> bool:
    from refitkit.refit import RefitCycle

    return "defer_optimizer" in inspect.signature(RefitCycle.resume).parameters


def run_mode(mode: Mode, module: ShapedWeights, optimizer, step, sender, peer, device, rounds: int) -> dict:
    from refitkit.engines.fsdp import FSDPAdapter
    from refitkit.refit import RefitCycle

    adapter = FSDPAdapter(module, optimizer)  # a fresh arena: the first round allocates (or prepare() did)
    adapter.pack_below_bytes = mode.pack_below
    baseline_s = statistics.median(_timed(step, device) for _ in range(2))
    result: dict = {"mode": mode.name, "baseline_step_s": baseline_s}
    if mode.prepare:
        began = time.perf_counter()
        reservation = adapter.prepare()
        result["prepare_call_s"] = time.perf_counter() - began
        result["overlapped_step_s"] = _timed(step, device)  # what background pinning costs the step it overlaps
        began = time.perf_counter()
        result["prepared_bytes"] = reservation.wait(TIMEOUT_S)
        result["prepare_wait_left_s"] = time.perf_counter() - began
        result["reserve_thread_s"] = reservation.seconds
    resume_kwargs = {"defer_optimizer": True} if mode.defer else {}
    counter = GcCounter()
    rows = []
    try:
        with RefitCycle(adapter, sender, overlap=mode.overlap, barrier_timeout_s=TIMEOUT_S) as cycle:
            for index in range(1 + rounds):
                step()
                _sync(device)
                counter.take()
                began = time.perf_counter()
                refit = cycle.refit(index)
                refit_wall_s = time.perf_counter() - began  # the call, not only its phases' sum
                if not peer.poll(TIMEOUT_S) or peer.recv() != "received":
                    raise RuntimeError("the receiver process did not finish its session")
                began = time.perf_counter()
                resume = cycle.resume(index, **resume_kwargs)
                resume_wall_s = time.perf_counter() - began
                gc_counts = counter.take()
                next_step_s = _timed(step, device)
                phases = {p.name: p for p in refit.phases}
                rows.append(
                    {
                        "round": "first" if index == 0 else "steady",
                        "sync_ms": phases["sync_weights"].seconds * 1e3,
                        "sync_bytes": phases["sync_weights"].bytes,
                        "offload_s": phases["offload"].seconds,
                        "offload_bytes": phases["offload"].bytes,
                        "flush_ms": phases["flush_device"].seconds * 1e3,
                        "barrier_ms": phases["barrier"].seconds * 1e3,
                        "refit_s": refit_wall_s,
                        "resume_s": resume_wall_s,
                        "refit_phases_s": refit.seconds,
                        "reload_s": resume.phase("reload").seconds,
                        "reload_bytes": resume.phase("reload").bytes,
                        "next_step_s": next_step_s,
                        "gc_by_generation": gc_counts,
                    }
                )
    finally:
        counter.close()
    result["rounds"] = rows
    result["fresh_reload_floor_s"] = fresh_reload_floor_s(adapter, device)
    result["storages"] = len([s for s in adapter.arena._slots.values() if not s.expired()])
    result["segment_sizes"] = sorted((s.capacity_bytes for s in adapter.arena._slots.values()), reverse=True)
    result["arena_bytes"] = adapter.arena.nbytes
    adapter.arena.release()
    return result


def bench_model(
    key: str, device: torch.device, rounds: int, modes: list[Mode], heap_objects: int, bucket_bytes: int
) -> dict:
    from refitkit.transfer import BucketedWeightSender

    config = MODELS[key]
    # A trainer's Python heap: what a full collection walks. Lists, not {"i": i} dicts: CPython leaves a dict of
    # ints untracked, so a heap of those is invisible to the collector (and makes every 10th gen-1 pass a full one).
    heap = [[i] for i in range(heap_objects)]
    module = ShapedWeights(config, device)
    cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-5, fused=cuda, foreach=False)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        module.loss().backward()
        optimizer.step()

    step()  # the optimizer state exists from here on
    endpoint = f"refit-cycle-{uuid.uuid4().hex[:8]}"
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    sessions = len(modes) * (1 + rounds) + 1  # and a last one whose weights the receiver's params are checked against
    peer = ctx.Process(target=receiver_main, args=(endpoint, device.type, sessions, child), daemon=True)
    peer.start()
    if not parent.poll(TIMEOUT_S) or parent.recv() != "ready":
        raise RuntimeError("the receiver process did not start")
    transport = "cuda_ipc" if cuda else "shm"
    results = []
    with BucketedWeightSender(endpoint, bucket_bytes=bucket_bytes, transport=transport, timeout_s=TIMEOUT_S) as sender:
        for mode in modes:
            results.append(run_mode(mode, module, optimizer, step, sender, parent, device, rounds))
            if cuda:
                torch.cuda.empty_cache()
        from refitkit.engines.fsdp import FSDPAdapter

        sent = sorted(FSDPAdapter(module, optimizer).named_weights())
        sender.send(iter(sent))
        if not parent.poll(TIMEOUT_S) or parent.recv() != "received":
            raise RuntimeError("the receiver process did not finish its last session")
    parent.send("checksum")
    intact = parent.poll(TIMEOUT_S) and parent.recv() == checksums(sent)
    peer.join(TIMEOUT_S)
    weight_bytes = sum(t.numel() * t.element_size() for t in module.parameters())
    # the model's memory back to the driver first, so the same segments fit again (a benchmark may collect)
    del heap, sent, step, module, optimizer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {
        "model": config.name,
        "weight_bytes": weight_bytes,
        "state_bytes": results[-1]["arena_bytes"],
        "intact": bool(intact),
        "modes": results,
        "bare_empty_cache_ms": bare_empty_cache_ms(results[-1]["segment_sizes"], device),
        "bare_regrow_ms": bare_regrow_ms(results[-1]["segment_sizes"], device),
    }


def summarize(model: dict, limits: dict | None) -> list[dict]:
    """One row per mode: the table's figures, steady = median over the steady rounds."""
    d2h = limits["pinned_d2h_gbps"] if limits else 0.0
    h2d = limits["pinned_h2d_gbps"] if limits else 0.0
    rows = []
    for mode in model["modes"]:
        first, steady = mode["rounds"][0], mode["rounds"][1:] or mode["rounds"]

        def med(key: str) -> float:
            return statistics.median(r[key] for r in steady)

        offload_gbps = med("offload_bytes") / med("offload_s") / 1e9 if med("offload_s") else 0.0
        first_gbps = first["offload_bytes"] / first["offload_s"] / 1e9 if first["offload_s"] else 0.0
        reload_gbps = med("reload_bytes") / med("reload_s") / 1e9 if med("reload_s") else 0.0
        # the longest of the overlapped phases: the sync, or the offload's bytes at the flat D2H rate
        bound_s = max(med("sync_ms") / 1e3, med("offload_bytes") / (d2h * 1e9) if d2h else 0.0)
        rows.append(
            {
                "model": model["model"],
                "mode": mode["mode"],
                "first_offload_gbps": first_gbps,
                "first_offload_x": first_gbps / d2h if d2h else None,
                "offload_gbps": offload_gbps,
                "offload_x": offload_gbps / d2h if d2h else None,
                "reload_gbps": reload_gbps,
                "reload_x": reload_gbps / h2d if h2d else None,
                # the reload's floor right after a flush: the same copies into memory the driver is still clearing
                "reload_x_floor": mode["fresh_reload_floor_s"] / med("reload_s")
                if mode.get("fresh_reload_floor_s") and med("reload_s")
                else None,
                "sync_ms": med("sync_ms"),
                "flush_ms": med("flush_ms"),
                "flush_x_bare": med("flush_ms") / model["bare_empty_cache_ms"]
                if model["bare_empty_cache_ms"]
                else None,
                "refit_s": med("refit_s"),
                "refit_x_bound": med("refit_s") / bound_s if bound_s else None,
                "resume_s": med("resume_s"),
                "next_step_s": med("next_step_s"),
                "step_cost_of_prepare_s": mode["overlapped_step_s"] - mode["baseline_step_s"]
                if "overlapped_step_s" in mode
                else None,
                "gc_by_generation": [sum(r["gc_by_generation"][g] for r in mode["rounds"]) for g in range(3)],
            }
        )
    return rows


def _fmt(value: object, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict]) -> None:
    print(
        f"{'model':>10} {'mode':>22} {'1st off GB/s':>13} {'off GB/s':>12} {'reload GB/s':>12} {'rl/floor':>8} {'sync ms':>8} "
        f"{'flush ms':>12} {'refit s':>13} {'resume s':>9} {'next step s':>11} {'prep cost s':>11} {'gc 0/1/2':>10}"
    )
    for r in rows:
        print(
            f"{r['model']:>10} {r['mode']:>22} {r['first_offload_gbps']:6.1f}={_fmt(r['first_offload_x'], '.2f'):>5}x "
            f"{r['offload_gbps']:6.1f}={_fmt(r['offload_x'], '.2f'):>4}x {r['reload_gbps']:6.1f}={_fmt(r['reload_x'], '.2f'):>4}x "
            f"{_fmt(r['reload_x_floor'], '.2f'):>8} {r['sync_ms']:8.1f} {r['flush_ms']:6.1f}={_fmt(r['flush_x_bare'], '.2f'):>4}x "
            f"{r['refit_s']:6.3f}={_fmt(r['refit_x_bound'], '.2f'):>5}x {r['resume_s']:9.3f} {r['next_step_s']:11.3f} "
            f"{_fmt(r['step_cost_of_prepare_s'], '.3f'):>11} {'/'.join(map(str, r['gc_by_generation'])):>10}"
        )
    print(
        "x: against the flat pinned D2H (offload) / H2D (reload) rate, the bare empty_cache of the same segments "
        "(flush), and the longest overlapped phase: max(sync, offload bytes at the flat D2H rate) (refit); rl/floor: the same "
        "allocations and copies, bare, right after a flush (fresh_reload_floor_s), over the reload's time"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="full", help="full: 8b then 0.6b shapes; tiny: CPU smoke"
    )
    parser.add_argument("--models", default=None, help="comma list of 8b, 0.6b, tiny (overrides --preset)")
    parser.add_argument("--modes", default=",".join(m.name for m in MODES))
    parser.add_argument("--rounds", type=int, default=3, help="steady rounds after the first, per mode")
    parser.add_argument("--heap-objects", type=int, default=None, help="Python objects in the trainer (2M; tiny: 20k)")
    parser.add_argument("--bucket-gib", type=float, default=2.0)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        from benchmarks.limits import measure_copy_limits

        torch.cuda.set_device(device.index or 0)
    models = args.models.split(",") if args.models else list(PRESETS[args.preset])
    heap_objects = (
        args.heap_objects if args.heap_objects is not None else (20_000 if args.preset == "tiny" else 2_000_000)
    )
    wanted = args.modes.split(",")
    modes = [m for m in MODES if m.name in wanted and (not m.defer or _defer_supported())]
    skipped = [m.name for m in MODES if m.name in wanted and m not in modes]
    limits = asdict(measure_copy_limits(2 << 30)) if device.type == "cuda" else None
    bucket = int(args.bucket_gib * (1 << 30)) if device.type == "cuda" else 8 << 20
    out = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "limits": limits,
        "heap_objects": heap_objects,
        "skipped_modes": skipped,
        "models": [bench_model(key, device, args.rounds, modes, heap_objects, bucket) for key in models],
    }
    out["table"] = [row for model in out["models"] for row in summarize(model, limits)]
    if limits:
        print(f"flat pinned copy: D2H {limits['pinned_d2h_gbps']:.1f} GB/s, H2D {limits['pinned_h2d_gbps']:.1f} GB/s")
    if skipped:
        print(f"skipped (this refitkit has no resume(defer_optimizer=...)): {', '.join(skipped)}")
    print_table(out["table"])
    for model in out["models"]:
        print(
            f"{model['model']}: receiver params {'match' if model['intact'] else 'DIFFER FROM'} the trainer's weights; "
            f"bare empty_cache of the same segments {model['bare_empty_cache_ms']:.1f} ms, "
            f"bare allocation of them {model['bare_regrow_ms']:.1f} ms"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    if not all(model["intact"] for model in out["models"]):
        raise SystemExit("the receiver's params differ from the trainer's weights")
    return out


if __name__ == "__main__":
    main()
