"""One copy where layouts allow: a broadcast received straight into an engine's fused parameters vs the bucket path.

The receiver (a spawned process) holds a Qwen3-style engine with vLLM's fused layout (q/k/v rows in
``qkv_proj``, gate/up rows in ``gate_up_proj``) and a loader that fills it the way vLLM's stacked-params
loader does. Its load plan is recorded once from that loader. Three ways of syncing the same bf16 weights
over gloo (CPU, 127.0.0.1), each the median of ``--rounds`` after ``--warmup``:

- ``bucket``: whole-bucket broadcasts, the loader copies each tensor out of the bucket (today's path);
- ``per-tensor``: one broadcast per tensor, still through the bucket and the loader (the cost of the cut);
- ``direct``: one broadcast per tensor, each landing in its parameter rows through the plan (no second copy).

Prints ms per sync, the receiver's time in its loader's copies (what landing in place removes), the share
of bytes that went direct, and the time saved against ``bucket``; the modes take turns each round; after
the last round of each mode the engine's parameters are checked against the sender's weights.

    python benchmarks/direct_receive.py [--model 0.6b|8b|tiny] [--layers 8] [--vocab 32768] [--bucket-mib 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a source checkout

from benchmarks.shapes import CONFIGS, DecoderConfig, weight_shapes  # noqa: E402

SECRET = "benchmark-secret-0123456789"
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class FusedEngine(torch.nn.Module):
    """Parameters in vLLM's fused layout for ``shapes`` (HF names and shapes); ``load_weights`` stacks rows."""

    def __init__(self, shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> None:
        super().__init__()
        fused: dict[str, list[tuple[int, ...]]] = {}
        plain: dict[str, tuple[int, ...]] = {}
        for name, shape in shapes:
            module = name.rsplit(".", 2)[-2]
            if module in STACKED:
                fused.setdefault(name.replace(module, STACKED[module][0]), []).append(shape)
            else:
                plain[name] = shape
        self.rows: dict[str, list[int]] = {}
        self.params = torch.nn.ParameterDict()
        for name, parts in fused.items():
            self.rows[name] = [0] + [sum(shape[0] for shape in parts[: i + 1]) for i in range(len(parts))]
            self.params[name.replace(".", "/")] = torch.nn.Parameter(
                torch.zeros(self.rows[name][-1], parts[0][1], dtype=dtype), requires_grad=False
            )
        for name, shape in plain.items():
            self.params[name.replace(".", "/")] = torch.nn.Parameter(
                torch.zeros(shape, dtype=dtype), requires_grad=False
            )

    def load_weights(self, weights: Any) -> None:
        for name, tensor in weights:
            module = name.rsplit(".", 2)[-2]
            if module in STACKED:
                target, index = STACKED[module]
                fused = name.replace(module, target)
                first, end = self.rows[fused][index], self.rows[fused][index + 1]
                self.params[fused.replace(".", "/")].data[first:end].copy_(tensor)
            else:
                self.params[name.replace(".", "/")].data.copy_(tensor)


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def scaled(model: str, layers: int, vocab: int) -> DecoderConfig:
    return dataclasses.replace(CONFIGS[model], num_hidden_layers=layers, vocab_size=vocab)


def sender_weights(config: DecoderConfig) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(name, torch.randn(shape, generator=generator).to(torch.bfloat16)) for name, shape in weight_shapes(config)]


def receiver_main(config: DecoderConfig, commands: Any, answers: Any) -> None:
    from refitkit.rollout.load_plan import record_load_plan
    from refitkit.transfer import BroadcastWeightReceiver

    torch.set_num_threads(1)
    shapes = weight_shapes(config)
    engine = FusedEngine(shapes, torch.bfloat16)
    plan_start = time.perf_counter()
    plan = record_load_plan(engine, engine.load_weights, shapes)
    answers.put(("ready", time.perf_counter() - plan_start, len(plan.destinations), len(shapes)))
    bound = plan.bind(engine)
    receivers: dict[str, BroadcastWeightReceiver] = {}
    while True:
        command = commands.get()
        if command is None:
            return
        url, direct, check = command
        receiver = receivers.setdefault(url, BroadcastWeightReceiver(url, secret=SECRET, rank=1, timeout_s=120.0))
        loader_s = [0.0]

        def on_bucket(weights: Any, last: bool) -> None:
            began = time.perf_counter()
            engine.load_weights(weights)
            loader_s[0] += time.perf_counter() - began

        receiver.receive(on_bucket, direct=bound if direct else None)
        sums = None
        if check:
            sums = {name: digest(param) for name, param in engine.params.items()}
        answers.put((receiver.last_direct.direct_share if receiver.last_direct else 0.0, sums, loader_s[0]))


def expected_sums(config: DecoderConfig, weights: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
    engine = FusedEngine(weight_shapes(config), torch.bfloat16)
    engine.load_weights(weights)
    return {name: digest(param) for name, param in engine.params.items()}


def free_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="0.6b", choices=["0.6b", "8b", "tiny"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    from refitkit.transfer import BroadcastWeightSender

    config = scaled({"0.6b": "Qwen3-0.6B", "8b": "Qwen3-8B", "tiny": "tiny"}[args.model], args.layers, args.vocab)
    weights = sender_weights(config)
    total = sum(tensor.nbytes for _, tensor in weights)
    want = expected_sums(config, weights)
    ctx = mp.get_context("spawn")
    commands, answers = ctx.Queue(), ctx.Queue()
    process = ctx.Process(target=receiver_main, args=(config, commands, answers), daemon=True)
    process.start()
    _, plan_s, planned, names = answers.get(timeout=600)
    print(
        f"{config.name} x{config.num_hidden_layers} layers, vocab {config.vocab_size}: {len(weights)} tensors, "
        f"{total / 2**20:.0f} MiB bf16; bucket {args.bucket_mib} MiB; gloo on 127.0.0.1"
    )
    print(f"load plan: {planned}/{names} names in place, recorded once in {plan_s * 1e3:.0f} ms")
    modes = {"bucket": (False, False), "per-tensor": (True, False), "direct": (True, True)}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    loaders: dict[str, list[float]] = {mode: [] for mode in modes}
    shares: dict[str, float] = {}
    senders = {
        mode: BroadcastWeightSender(
            free_url(),
            secret=SECRET,
            receivers=1,
            bucket_bytes=args.bucket_mib << 20,
            per_tensor=per_tensor,
            timeout_s=120.0,
        )
        for mode, (per_tensor, _) in modes.items()
    }
    try:
        for round_ in range(args.warmup + args.rounds):  # the modes take turns, so a busy moment hits them alike
            for mode, (_, direct) in modes.items():
                sender = senders[mode]
                check = round_ == args.warmup + args.rounds - 1
                commands.put((f"tcp://{sender.host}:{sender.port}", direct, check))
                start = time.perf_counter()
                sender.send(weights, version=round_)
                shares[mode], sums, loader_s = answers.get(timeout=600)  # the receiver is done loading too
                if round_ >= args.warmup:
                    times[mode].append(time.perf_counter() - start)
                    loaders[mode].append(loader_s)
                if check and sums != want:
                    raise SystemExit(f"{mode}: the engine's parameters do not match the sender's weights")
        base = statistics.median(times["bucket"])
        for mode in modes:
            median = statistics.median(times[mode])
            saved = (
                ""
                if mode == "bucket"
                else f"  saved vs bucket {(base - median) * 1e3:+.1f} ms ({(base - median) / base:+.0%})"
            )
            loader_ms = statistics.median(loaders[mode]) * 1e3
            print(
                f"{mode:>10}: {median * 1e3:8.1f} ms/sync  {total / median / 1e9:5.2f} GB/s  loader copies {loader_ms:6.1f} ms  "
                f"direct share {shares[mode]:6.1%}{saved}"
            )
    finally:
        for sender in senders.values():
            sender.close()
        commands.put(None)
        process.join(60)
        if process.is_alive():
            process.kill()


if __name__ == "__main__":
    main()
