"""The refit cycle on every GPU of a node at once, against the same run's concurrent copy limits.

One process per GPU (spawned). First the flat limits: a pinned D2H and H2D copy of ``--flat-gib``
on every GPU at once (per GPU and in total) and on GPU 0 alone. Then FSDP2 over all ranks on a
Qwen3-shaped model (``--model 8b|0.6b|tiny``, bf16 params, AdamW) and the full ``RefitCycle`` per
rank: train, stream the full weights, offload, flush, barrier, reload (the arena pinned ahead with
``adapter.prepare()`` unless ``--no-prepare``). ``--receivers per-gpu``
(default): every rank streams to a receiver process on its own GPU that copies the weights into
its own tensors (one data-parallel engine per GPU, each holding the whole model);
``--receivers rank0``: only rank 0 sends, the others take part in the gathers. Each receiver's
checksums are compared with the trainer's. Rank 0 prints one JSON line for the limits and one
per round: per-rank and total offload / reload GB/s and their ratio to the concurrent flat
limit, sync ms, and the barrier's wait on the slowest rank (``RefitReport`` phases).

    python -m benchmarks.node_cycle --nproc 8 --model 8b              # a node of H200s (also 2 or 4)
    python -m benchmarks.node_cycle --nproc 2 --model 0.6b --receivers rank0
    python -m benchmarks.node_cycle --device cpu --backend gloo --model tiny --nproc 2   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a source checkout

from benchmarks.shapes import CONFIGS, QWEN3_0_6B, QWEN3_8B, DecoderConfig, weight_shapes  # noqa: E402

MODELS: dict[str, DecoderConfig] = {"8b": QWEN3_8B, "0.6b": QWEN3_0_6B, "tiny": CONFIGS["tiny"]}
TIMEOUT_S = 600.0
RECORD_BYTES = 1 << 16  # one rank's JSON record in the gather


class Node(nn.Module):
    """A module of a Qwen3 checkpoint's tree; its forward is the sum of squares of its params and children's.

    No attention kernel: the point is FSDP2's real all-gathers and reduce-scatters per layer and a
    dense grad (and AdamW state) for every param, with the checkpoint's exact names and shapes.
    """

    def forward(self) -> torch.Tensor:
        total = sum((p * p).sum() for p in self._parameters.values() if p is not None) * 1e-3
        for child in self.children():
            total = total + child()
        return total


def build_model(config: DecoderConfig, device: torch.device) -> Node:
    """The checkpoint's weights (bf16, the same on every rank) in modules named as in the checkpoint."""
    root = Node()
    generator = torch.Generator(device=device).manual_seed(0)
    for name, shape in weight_shapes(config):
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, Node())
            module = getattr(module, part)
        weight = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16) * 0.02
        module.register_parameter(leaf, nn.Parameter(weight))
    return root


def checksums(named) -> list[list]:
    """(name, sum of the tensor's 16-bit words) per weight, sorted by name: cheap, on the device."""
    out = [[name, int(tensor.detach().contiguous().view(torch.int16).sum(dtype=torch.int64))] for name, tensor in named]
    return sorted(out)


def receiver_main(endpoint: str, device: str, rounds: int, conn) -> None:
    """One engine: copies each sync into its own tensors and answers with their checksums."""
    from refitkit.transfer import BucketedWeightReceiver

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    receiver = BucketedWeightReceiver(endpoint, device, timeout_s=TIMEOUT_S)
    params: dict[str, torch.Tensor] = {}

    def load(weights, is_last: bool) -> None:
        for name, tensor in weights:
            if name not in params:  # allocated in the first session only, like an engine's params
                params[name] = torch.empty_like(tensor)
            params[name].copy_(tensor)  # views are valid only during this call

    conn.send_bytes(b"ready")
    for _ in range(rounds):
        receiver.receive(load)
        conn.send_bytes(json.dumps(checksums(params.items())).encode())


def _expect(conn, what: str) -> bytes:
    if not conn.poll(TIMEOUT_S):
        raise TimeoutError(f"receiver: no {what} within TIMEOUT_S={TIMEOUT_S} s")
    return conn.recv_bytes()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gather_records(record: dict, device: torch.device) -> list[dict]:
    """Every rank's JSON record, on every rank (fixed-size byte tensors: data, never pickle)."""
    payload = json.dumps(record).encode()
    if len(payload) > RECORD_BYTES:
        raise ValueError(f"rank record of {len(payload)} bytes is over RECORD_BYTES={RECORD_BYTES}")
    mine = torch.zeros(RECORD_BYTES, dtype=torch.uint8, device=device)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [json.loads(bytes(t.cpu().numpy()).rstrip(b"\0")) for t in everyone]


def _host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return torch.empty(nbytes, dtype=torch.uint8)  # CPU run: a plain memcpy, nothing to pin
    from benchmarks.limits import exact_pinned_buffer

    return exact_pinned_buffer(nbytes)  # what HostArena uses (cudaHostRegister of exact size)


def flat_limits(nbytes: int, device: torch.device, repeats: int = 3) -> dict | None:
    """Pinned D2H and H2D of ``nbytes`` on every rank at once, then on rank 0 alone (best of ``repeats``).

    A barrier lines the ranks up before each concurrent copy; the total is all ranks' bytes over
    the slowest rank's copy time. Returns the summary on rank 0, None elsewhere.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device_buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host_buffer = _host_buffer(nbytes, device)
    copies = {
        "d2h": lambda: host_buffer.copy_(device_buffer, non_blocking=True),
        "h2d": lambda: device_buffer.copy_(host_buffer, non_blocking=True),
    }

    def timed(copy) -> float:
        _sync(device)
        start = time.perf_counter()
        copy()
        _sync(device)
        return time.perf_counter() - start

    summary: dict = {"flat_bytes_per_gpu": nbytes}
    for direction, copy in copies.items():
        copy()  # warm
        best_total, best_per_gpu = 0.0, [0.0] * world
        for _ in range(repeats):
            _sync(device)
            dist.barrier()
            seconds = gather_records({"s": timed(copy)}, device)
            per_gpu = [nbytes / r["s"] / 1e9 for r in seconds]
            total = world * nbytes / max(r["s"] for r in seconds) / 1e9
            if total > best_total:
                best_total, best_per_gpu = total, per_gpu
        dist.barrier()
        alone = max(nbytes / timed(copy) / 1e9 for _ in range(repeats)) if rank == 0 else 0.0
        dist.barrier()
        summary[f"concurrent_{direction}_gbps_per_gpu"] = [round(g, 2) for g in best_per_gpu]
        summary[f"concurrent_{direction}_gbps_total"] = round(best_total, 2)
        summary[f"alone_{direction}_gbps"] = round(alone, 2)
    if device.type == "cuda":
        from benchmarks.limits import unpin

        unpin(host_buffer)
    copies.clear()  # the copies held the buffers: the model gets the device memory back
    device_buffer = host_buffer = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return summary if rank == 0 else None


def rank_main(rank: int, args: argparse.Namespace, store_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from refitkit.engines.fsdp import FSDPAdapter
    from refitkit.refit import RefitCycle
    from refitkit.transfer import BucketedWeightSender

    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # the CPU smoke shares a small box with its receivers
    store = dist.FileStore(store_path, args.nproc)
    dist.init_process_group(
        args.backend,
        store=store,
        rank=rank,
        world_size=args.nproc,
        device_id=device if args.backend == "nccl" else None,
    )
    limits = flat_limits(int(args.flat_gib * (1 << 30)), device)
    if limits is not None:
        print(json.dumps({"limits": limits, "world_size": args.nproc, "device": str(device.type)}), flush=True)

    config = MODELS[args.model]
    model = build_model(config, device)
    mesh = init_device_mesh(device.type, (args.nproc,))
    for layer in model.model.layers.children():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=device.type == "cuda")

    def step() -> float:
        loss = model()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.item())

    sends = args.receivers == "per-gpu" or rank == 0
    sender = receiver = conn = None
    if sends:
        endpoint = f"refitkit-node-{uuid.uuid4().hex[:8]}"
        transport = "cuda_ipc" if device.type == "cuda" else "shm"
        sender = BucketedWeightSender(
            endpoint, bucket_bytes=args.bucket_mib << 20, transport=transport, timeout_s=TIMEOUT_S
        )
        context = mp.get_context("spawn")
        conn, child = context.Pipe()
        receiver = context.Process(target=receiver_main, args=(endpoint, str(device), args.rounds, child))
        receiver.start()
        child.close()
        if _expect(conn, "start") != b"ready":
            raise RuntimeError(f"rank {rank}: the receiver did not start")
    cycle = RefitCycle(FSDPAdapter(model, optimizer), sender, barrier_timeout_s=TIMEOUT_S)
    adapter = cycle.adapter
    arena_pin_s = None
    if args.prepare:  # pin the arena off the critical path (as trainers would), so round 0 is a steady round too
        step()  # the AdamW state exists from here: the arena is sized for it
        start = time.perf_counter()
        adapter.prepare().wait(TIMEOUT_S)
        arena_pin_s = time.perf_counter() - start
    try:
        for round_index in range(args.rounds):
            loss = step()
            expected = checksums(adapter.named_weights())  # a collective: every rank iterates
            state_bytes = adapter.state_bytes().device_bytes
            _sync(device)
            dist.barrier()  # every rank starts its refit together: the offloads share the host's bandwidth
            refit = cycle.refit(round_index)
            left_on_device = adapter.state_bytes().device_bytes
            matches = json.loads(_expect(conn, f"checksums of round {round_index}")) == expected if sends else None
            dist.barrier()  # the reloads start together too
            resume = cycle.resume(round_index)
            offload, reload = refit.phase("offload"), resume.phase("reload")
            record = {
                "rank": rank,
                "loss": loss,
                "matches": matches,
                "state_bytes": state_bytes,
                "left_on_device": left_on_device,
                "sync_s": refit.phase("sync_weights").seconds,
                "sync_bytes": refit.phase("sync_weights").bytes,
                "offload_bytes": offload.bytes,
                "offload_s": offload.seconds,
                "flush_s": refit.phase("flush_device").seconds,
                "barrier_s": refit.phase("barrier").seconds,
                "reload_bytes": reload.bytes,
                "reload_s": reload.seconds,
                "resume_barrier_s": resume.phase("barrier").seconds,
                "arena_pin_s": arena_pin_s if round_index == 0 else None,
            }
            records = gather_records(record, device)
            if rank == 0:
                print(json.dumps(summarize(round_index, records, limits, args)), flush=True)
        step()  # trains again after the last reload
    finally:
        cycle.close()
        if sender is not None:
            sender.close()
        if receiver is not None:
            receiver.join(60.0)
            if receiver.is_alive():
                receiver.kill()
        dist.destroy_process_group()


def summarize(round_index: int, records: list[dict], limits: dict | None, args: argparse.Namespace) -> dict:
    """One round across ranks: per-rank rates, totals (all bytes over the slowest rank), ratios to the flat limits."""

    def gbps(nbytes: int, seconds: float) -> float:
        return round(nbytes / seconds / 1e9, 2) if seconds > 0 else 0.0

    limits = limits or {}
    d2h = limits.get("concurrent_d2h_gbps_per_gpu", [0.0] * len(records))
    h2d = limits.get("concurrent_h2d_gbps_per_gpu", [0.0] * len(records))
    offload = [gbps(r["offload_bytes"], r["offload_s"]) for r in records]
    reload = [gbps(r["reload_bytes"], r["reload_s"]) for r in records]
    barrier_ms = [round(r["barrier_s"] * 1e3, 2) for r in records]
    total_offload = gbps(sum(r["offload_bytes"] for r in records), max(r["offload_s"] for r in records))
    total_reload = gbps(sum(r["reload_bytes"] for r in records), max(r["reload_s"] for r in records))

    def ratio(value: float, limit: float) -> float | None:
        return round(value / limit, 3) if limit else None

    return {
        "round": round_index,
        "model": args.model,
        "world_size": len(records),
        "receivers": "one per GPU, each loads the full weights (a data-parallel engine per GPU)"
        if args.receivers == "per-gpu"
        else "one, on GPU 0 (rank 0 sends; the other ranks only gather)",
        "receivers_match": [r["matches"] for r in records],
        "loss": records[0]["loss"],
        "state_bytes_per_rank": [r["state_bytes"] for r in records],
        "left_on_device": [r["left_on_device"] for r in records],
        "sync_ms_per_rank": [round(r["sync_s"] * 1e3, 2) for r in records],
        "sync_gbps_per_rank": [gbps(r["sync_bytes"], r["sync_s"]) for r in records],
        "offload_gbps_per_rank": offload,
        "offload_vs_concurrent_d2h": [ratio(g, lim) for g, lim in zip(offload, d2h)],
        "offload_gbps_total": total_offload,
        "offload_total_vs_concurrent": ratio(total_offload, limits.get("concurrent_d2h_gbps_total", 0)),
        "flush_ms_per_rank": [round(r["flush_s"] * 1e3, 2) for r in records],
        "reload_gbps_per_rank": reload,
        "reload_vs_concurrent_h2d": [ratio(g, lim) for g, lim in zip(reload, h2d)],
        "reload_gbps_total": total_reload,
        "reload_total_vs_concurrent": ratio(total_reload, limits.get("concurrent_h2d_gbps_total", 0)),
        "barrier_ms_per_rank": barrier_ms,
        # the rank that arrived last waits least; the longest wait is what the others paid for it
        "barrier_wait_on_slowest_ms": max(barrier_ms),
        "slowest_rank": barrier_ms.index(min(barrier_ms)),
        "resume_barrier_ms_per_rank": [round(r["resume_barrier_s"] * 1e3, 2) for r in records],
        "arena_pinned_ahead_s_per_rank": [r["arena_pin_s"] and round(r["arena_pin_s"], 3) for r in records],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=max(1, torch.cuda.device_count()))
    parser.add_argument("--model", choices=sorted(MODELS), default="8b")
    parser.add_argument("--receivers", choices=["per-gpu", "rank0"], default="per-gpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument(
        "--no-prepare",
        dest="prepare",
        action="store_false",
        help="do not pin the arena ahead (adapter.prepare()): round 0 then pays the pinning in its offload",
    )
    parser.add_argument(
        "--flat-gib", type=float, default=None, help="bytes per GPU of the flat copies (default 4 GiB; CPU 64 MiB)"
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="default: nccl on cuda, gloo on cpu")
    args = parser.parse_args(argv)
    args.backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cpu" and args.backend != "gloo":
        parser.error("--device cpu needs --backend gloo")
    if args.device == "cuda" and args.nproc > torch.cuda.device_count():
        parser.error(f"--nproc {args.nproc}: only {torch.cuda.device_count()} GPUs here")
    if args.flat_gib is None:
        args.flat_gib = 4.0 if args.device == "cuda" else 1 / 16
    with tempfile.TemporaryDirectory(prefix="refitkit-node-") as tmp:
        context = mp.get_context("spawn")
        procs = [
            context.Process(target=rank_main, args=(rank, args, os.path.join(tmp, "store")))
            for rank in range(args.nproc)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + 120.0 * (5 + args.rounds)
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        failed = [rank for rank, proc in enumerate(procs) if proc.exitcode != 0]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10.0)
        if failed:
            sys.exit(f"ranks {failed} failed or timed out (see their tracebacks above)")


if __name__ == "__main__":
    main()
