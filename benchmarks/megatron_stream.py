"""Megatron weight streaming in Hugging Face names: GB/s of named_weights() alone and into a CUDA IPC
receiver, against the flat device-to-device copy rate measured in the same run.

One GPU, from the repo root (megatron-core on the path, no shim):
    python benchmarks/megatron_stream.py --hidden-size 2048 --num-layers 20
Several GPUs, any TP / PP / EP (one receiver process per streaming rank, on that rank's GPU):
    torchrun --nproc-per-node 2 benchmarks/megatron_stream.py --tp 2
    torchrun --nproc-per-node 2 benchmarks/megatron_stream.py --ep 2 --moe
Streaming ranks are those ``refitkit.engines.megatron.is_stream_source()`` picks: one per (pipeline
stage, expert-parallel rank); the other ranks iterate named_weights() alongside (the gathers).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.limits import measure_copy_limits  # noqa: E402


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(args: argparse.Namespace) -> dict:
    """Build, train a step, time a bare named_weights() pass and ``--rounds`` streams into a receiver."""
    from refitkit.engines.megatron import MegatronAdapter, is_stream_source
    from refitkit.transfer import BucketedWeightSender
    from tests.engines.megatron import parallel_gpt
    from tests.engines.megatron.parallel_gpt import Layout
    from tests.helpers.world import child_env

    layout = Layout(
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        moe=args.moe,
        family="qwen3_moe" if args.moe else "qwen3",
        hidden=args.hidden_size,
        heads=args.hidden_size // 128,
        groups=max(1, args.hidden_size // 256),
        head_dim=128,
        ffn=3 * args.hidden_size,
        moe_ffn=args.hidden_size // 2,
        num_layers=args.num_layers,
        vocab=32_000,
    )
    trainer = parallel_gpt.build_trainer(layout)
    parallel_gpt.train_step(trainer, 0)
    adapter = MegatronAdapter(trainer.chunks, trainer.optimizer, hf_family=layout.family)

    torch.cuda.synchronize()
    start = time.perf_counter()
    pass_bytes = sum(t.numel() * t.element_size() for _, t in adapter.named_weights())
    torch.cuda.synchronize()
    pass_s = time.perf_counter() - start

    streaming = is_stream_source()
    rows = []
    endpoint = f"megatron-stream-{os.getpid()}"
    receiver = None
    if streaming:
        # one receiver for every round, started before the first: round 0 pays its start, later rounds only the stream
        with BucketedWeightSender(
            endpoint, bucket_bytes=args.bucket_mib << 20, transport="cuda_ipc", timeout_s=300.0
        ) as sender:
            receiver = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.engines.megatron.stream_receiver",
                    endpoint,
                    "-",
                    "300",
                    str(args.rounds),
                ],
                env=child_env(CUDA_VISIBLE_DEVICES=str(torch.cuda.current_device())),
            )
            try:
                for round_index in range(args.rounds):
                    torch.distributed.barrier()
                    stats = sender.send(adapter.named_weights())
                    rows.append(
                        {"round": round_index, "bytes": stats.bytes, "seconds": stats.seconds, "gbps": stats.gbps}
                    )
            finally:
                receiver.wait(timeout=300)
    else:
        for _ in range(args.rounds):
            torch.distributed.barrier()
            for _ in adapter.named_weights():  # the gathers are collectives: every rank iterates
                pass
    limits = measure_copy_limits(min(pass_bytes, 1 << 30), repeats=5)
    steady = rows[1:] or rows
    stream_gbps = sum(r["bytes"] for r in steady) / sum(r["seconds"] for r in steady) / 1e9 if steady else 0.0
    return {
        "rank": torch.distributed.get_rank(),
        "layout": {"tp": args.tp, "pp": args.pp, "ep": args.ep, "moe": args.moe},
        "streaming_rank": streaming,
        "named_weights_pass_gbps": pass_bytes / pass_s / 1e9,
        "stream_gbps": stream_gbps,
        "flat_d2d_gbps": limits.d2d_gbps,
        "stream_vs_d2d": stream_gbps / limits.d2d_gbps,
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-layers", type=int, default=20)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--moe", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument("--json", default=None, help="also write this rank's figures to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/megatron_stream.py needs a CUDA GPU")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.distributed.init_process_group("nccl", rank=rank, world_size=world_size)
    try:
        result = run(args)
    finally:
        torch.distributed.destroy_process_group()
    for key, value in result.items():
        if key != "rows":
            print(
                f"rank {result['rank']} {key}: {value:.3f}"
                if isinstance(value, float)
                else f"rank {result['rank']} {key}: {value}"
            )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main()
