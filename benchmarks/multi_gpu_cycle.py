"""The whole RefitCycle on N ranks: train, stream to a receiver, offload, barrier, reload, train again.

Every rank trains an FSDP2 model (``--engine fsdp``: a Qwen3-shaped decoder stack) or a
torchtitan trainer's own objects (``--engine torchtitan``: its model parts, FSDP x TP via
``--tp``, and its OptimizersContainer, streamed under HF names through its StateDictAdapter).
Rank 0 streams the full weights to a receiver process on its own device (CUDA IPC on a GPU,
shared memory on CPU) that copies them into its own tensors and returns a digest, checked
against the trainer's. Every rank offloads and reloads. Rank 0 prints one JSON line per round
(sync ms, offload / reload GB/s) and the same run's flat pinned-copy rates to compare with.

    python -m benchmarks.multi_gpu_cycle --nproc 1                             # one GPU, FSDP2
    python -m benchmarks.multi_gpu_cycle --nproc 1 --engine torchtitan         # one GPU, torchtitan
    python -m benchmarks.multi_gpu_cycle --nproc 8 --engine torchtitan --tp 2  # 2-8 GPUs, unchanged
    python -m benchmarks.multi_gpu_cycle --nproc 2 --device cpu --layers 2 --vocab 1000 --hidden 64 --rounds 2  # CPU smoke
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import uuid

import torch
import torch.distributed as dist
from torch import nn

RECEIVER_TIMEOUT_S = 300.0


class DecoderLayer(nn.Module):
    """A Qwen3-0.6B-shaped layer with a cheap trainable forward (no attention kernel needed)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        h = self.down_proj(nn.functional.silu(self.gate_proj(h)) * self.up_proj(h))
        return x + self.o_proj(h)


class DecoderStack(nn.Module):
    def __init__(self, layers: int, vocab: int = 151936, hidden: int = 1024, intermediate: int = 3072) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(DecoderLayer(hidden, intermediate) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build_fsdp(args: argparse.Namespace, device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from refitkit.engines.fsdp import FSDPAdapter

    torch.manual_seed(0)
    model = DecoderStack(args.layers, vocab=args.vocab, hidden=args.hidden, intermediate=3 * args.hidden).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=device.type == "cuda")

    def step(round_index: int) -> float:
        tokens = torch.randint(0, args.vocab, (2, 128), device=device, generator=_generator(device, round_index))
        loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return FSDPAdapter(model, optimizer), step


def build_torchtitan(args: argparse.Namespace, device: torch.device):
    """torchtitan's own trainer objects (GPU): model parts parallelized by its parallelize_fn, its optimizers."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel_ce_loss

    from refitkit.engines.torchtitan import TorchTitanAdapter

    world_size = dist.get_world_size()
    config = llama3_debugmodel_ce_loss()
    config.parallelism.tensor_parallel_degree = args.tp
    config.parallelism.data_parallel_shard_degree = world_size // args.tp
    config.training.seq_len = 256
    config.training.local_batch_size = 2
    config.activation_checkpoint = None
    config.compile.enable = False
    model_config = config.model_spec.model
    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()  # no flex-attention compile
    parallel_dims = ParallelDims.from_config(config.parallelism, world_size)
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    model = config.model_spec.parallelize_fn(
        model,
        parallel_dims=parallel_dims,
        training=config.training,
        parallelism=config.parallelism,
        compile_config=config.compile,
        ac_config=None,
        dump_folder=tempfile.gettempdir(),
    )
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizers = config.optimizer.build(model_parts=[model])
    loss_fn = config.loss.build(compile_config=config.compile)
    sd_adapter = config.model_spec.state_dict_adapter(model_config, None)

    def step(round_index: int) -> float:
        tokens = torch.randint(
            0, model_config.vocab_size, (2, 257), device=device, generator=_generator(device, round_index)
        )
        loss, _ = loss_fn(
            model(tokens[:, :-1]), tokens[:, 1:], global_valid_tokens=torch.tensor(float(2 * 256), device=device)
        )
        loss.backward()
        optimizers.step()
        optimizers.zero_grad()
        return loss.item()

    return TorchTitanAdapter([model], optimizers, state_dict_adapter=sd_adapter), step


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(1000 * dist.get_rank() + seed)


def digest_of(named) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        h.update(name.encode())
        # clone first: numpy() marks a storage non-resizable, which offload must refuse
        h.update(tensor.detach().cpu().clone().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def receiver_main(endpoint: str, device: str, rounds: int, conn) -> None:
    """The inference side: copies each round's stream into its own tensors and answers with their digest."""
    from refitkit.transfer import BucketedWeightReceiver

    receiver = BucketedWeightReceiver(endpoint, device, timeout_s=RECEIVER_TIMEOUT_S)
    params: dict[str, torch.Tensor] = {}

    def load(weights, is_last: bool) -> None:
        for name, tensor in weights:
            if name not in params:
                params[name] = torch.empty_like(tensor)
            params[name].copy_(tensor)  # views are valid only during this call

    conn.send_bytes(b"ready")
    for _ in range(rounds):
        receiver.receive(load)
        conn.send_bytes(digest_of(params.items()).encode())


def rank_main(rank: int, args: argparse.Namespace, store_path: str) -> None:
    from benchmarks.fsdp_offload import flat_memcpy_gbps
    from refitkit.refit import RefitCycle
    from refitkit.transfer import BucketedWeightSender

    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.FileStore(store_path, args.nproc)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=args.nproc, device_id=device if device.type == "cuda" else None
    )
    adapter, step = (build_torchtitan if args.engine == "torchtitan" else build_fsdp)(args, device)
    sender = receiver = parent = None
    if rank == 0:
        endpoint = f"refitkit-cycle-{uuid.uuid4().hex[:8]}"
        transport = "cuda_ipc" if device.type == "cuda" else "shm"
        sender = BucketedWeightSender(
            endpoint,
            bucket_bytes=args.bucket_mib << 20,
            transport=transport,
            timeout_s=RECEIVER_TIMEOUT_S,
            direct=args.path == "direct",
        )
        context = mp.get_context("spawn")
        parent, child = context.Pipe()
        receiver = context.Process(target=receiver_main, args=(endpoint, str(device), args.rounds, child))
        receiver.start()
        child.close()
        _expect(parent, b"ready", "start")
    cycle = RefitCycle(adapter, sender, barrier_timeout_s=300.0)
    try:
        for round_index in range(args.rounds):
            loss = step(round_index)
            expected = digest_of(adapter.named_weights())  # a collective on every rank; rank 0 keeps it
            refit = cycle.refit(round_index)
            device_bytes = adapter.state_bytes().device_bytes
            got = _expect(parent, None, f"digest of round {round_index}") if rank == 0 else expected
            resume = cycle.resume(round_index)
            if rank == 0:
                offload, reload = refit.phase("offload"), resume.phase("reload")
                print(
                    json.dumps(
                        {
                            "round": round_index,
                            "engine": args.engine,
                            "world_size": args.nproc,
                            "loss": round(loss, 4),
                            "receiver_matches": got == expected,
                            "device_bytes_offloaded": device_bytes,
                            "sync_ms": round(refit.phase("sync_weights").seconds * 1e3, 2),
                            "offload_gbps": round(offload.gbps, 2),
                            "reload_gbps": round(reload.gbps, 2),
                            "refit_ms": round(refit.seconds * 1e3, 2),
                            "resume_ms": round(resume.seconds * 1e3, 2),
                            "path": args.path,
                            "split": sender.last_split.__dict__ if sender.last_split else None,
                        }
                    ),
                    flush=True,
                )
        step(args.rounds)  # trains again after the last reload
        if rank == 0:
            nbytes = adapter.state_bytes().model.device_bytes + adapter.state_bytes().optimizer.device_bytes
            d2h, h2d = flat_memcpy_gbps(nbytes, device, rounds=3)
            print(
                json.dumps(
                    {
                        "flat_pinned_d2h_gbps": round(d2h, 2),
                        "flat_pinned_h2d_gbps": round(h2d, 2),
                        "bytes_per_rank": nbytes,
                    }
                ),
                flush=True,
            )
    finally:
        if sender is not None:
            sender.close()
        if receiver is not None:
            receiver.join(30.0)
            if receiver.is_alive():
                receiver.kill()
        dist.destroy_process_group()


def _expect(conn, value: bytes | None, what: str) -> str:
    if not conn.poll(RECEIVER_TIMEOUT_S):
        raise TimeoutError(f"receiver: no {what} within RECEIVER_TIMEOUT_S={RECEIVER_TIMEOUT_S} s")
    got = conn.recv_bytes()
    if value is not None and got != value:
        raise RuntimeError(f"receiver sent {got!r} for its {what}")
    return got.decode()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=max(1, torch.cuda.device_count()))
    parser.add_argument("--engine", choices=["fsdp", "torchtitan"], default="fsdp")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (torchtitan); FSDP over the rest")
    parser.add_argument("--layers", type=int, default=28, help="decoder layers of the fsdp model (Qwen3-0.6B: 28)")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--bucket-mib", type=int, default=512)
    parser.add_argument(
        "--path",
        choices=("direct", "bucket"),
        default="direct",
        help="the sender's path: direct (gathered weights read where they lie) or bucket (direct=False)",
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="refitkit-cycle-") as tmp:
        context = mp.get_context("spawn")
        procs = [
            context.Process(target=rank_main, args=(rank, args, os.path.join(tmp, "store")))
            for rank in range(args.nproc)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + 60.0 * (5 + args.rounds)
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        failed = [rank for rank, proc in enumerate(procs) if proc.exitcode != 0]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        if failed:
            sys.exit(f"ranks {failed} failed or timed out (see their tracebacks above)")


if __name__ == "__main__":
    main()
