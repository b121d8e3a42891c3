"""Broadcast weight sync (disaggregated rollout): a trainer process on GPU 0 streams Qwen3-shaped bf16 weights to
``--receivers`` engine processes on GPUs 1..N through ``BroadcastWeightSender`` / ``BroadcastWeightReceiver`` (NCCL).

Every process is started here with torch.multiprocessing's spawn (no torchrun). Each of ``--rounds`` syncs
changes one 16-bit word of every weight, then hands ``send()`` a generator of (name, tensor), as a
trainer's ``named_weights()`` does; each receiver copies every bucket's tensors into its own
preallocated parameters (``--direct``: lands them there with no bucket, through ``receive(direct=...)``).
After each sync the receivers' parameters are checked bit-exact against the sender's weights (a digest
computed on the device). Per sync: ms (the whole ``send()``: admission, forming the session's group,
streaming, every receiver's status), "group ms" (the group's constructor only: NCCL forms its communicator
inside the first broadcast, so that cost is in "stream GB/s"; the floor line's "its group and first
broadcast" is what forming one costs), GB/s, and the ratio to the same
run's floor: a ``copy_`` of the same bytes GPU 0 -> GPU 1 (peer to peer) and an NCCL broadcast of one flat
buffer of the same size over an already formed group (the transport's floor).

``--kill-receiver-at-bucket K``: receiver rank 1 SIGKILLs itself inside bucket K's ``on_bucket``; the
sender must end in TransferTimeout or TransferError (naming phase, bucket and peer) within ``--timeout-s``
+ ``--slack-s``; then a restarted receiver and a new session must land the weights bit-exact.

    python benchmarks/broadcast_sync.py --kill-receiver-at-bucket 10 --json broadcast_sync.json   # 2 GPUs, Qwen3-8B
    python benchmarks/broadcast_sync.py --receivers 3 --rounds 5                                    # 4 GPUs
    python benchmarks/broadcast_sync.py --backend gloo --device cpu --model tiny --rounds 1 --bucket-mib 1 \\
        --kill-receiver-at-bucket 2                                                                  # CPU smoke run

Exits 1 when a sync was not bit-exact or the kill case missed its bound.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import secrets
import signal
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a source checkout

from benchmarks.shapes import CONFIGS, QWEN3_0_6B, QWEN3_8B, weight_shapes  # noqa: E402

MODELS = {"8b": QWEN3_8B, "0.6b": QWEN3_0_6B, "tiny": CONFIGS["tiny"]}
MIB = 1 << 20
CHUNK = 1 << 26  # words per digest step: bounds the digest's temporaries (~1.5 GiB) on an 8B model
SPAWN_TIMEOUT_S = 300.0  # a spawned process imports torch and builds its weights (16 GB on the GPU for 8b)
FLOOR_REPS = 3
TRANSFER_ERRORS = ("TransferError", "TransferTimeout", "PeerGone")


def device_of(args: argparse.Namespace, rank: int) -> torch.device:
    return torch.device("cpu") if args.device == "cpu" else torch.device("cuda", rank)


def synchronize(*devices: torch.device) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def digest(tensors: list[torch.Tensor]) -> str:
    """A fingerprint of the tensors' bytes, computed where they live: per chunk of 16-bit words their sum and
    their position-weighted sum (a changed or moved word changes it), hashed. Equal digests: bit-exact."""
    sums = []
    for tensor in tensors:
        words = tensor.reshape(-1).view(torch.int16)  # every weight here is bf16
        for start in range(0, words.numel(), CHUNK):
            part = words[start : start + CHUNK].to(torch.int64)
            weight = torch.arange(start, start + part.numel(), device=part.device) % 65521 + 1
            sums.append(torch.stack([part.sum(), (part * weight).sum()]))
    values = torch.stack(sums).cpu().tolist() if sums else []
    return hashlib.sha256(json.dumps(values).encode()).hexdigest()


def touch(weights: dict[str, torch.Tensor], version: int) -> None:
    """Flip bits of one word of every weight, so that each sync carries bytes the receivers do not hold yet."""
    for tensor in weights.values():
        words = tensor.view(-1).view(torch.int16)
        index = version * 7919 % words.numel()
        words[index : index + 1].bitwise_xor_(version % 32767 + 1)


def finish(work: Any, device: torch.device, timeout_s: float, what: str) -> None:
    """Wait (bounded) for one collective of the floor measurement."""
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not complete within --timeout-s={timeout_s:g}")
        time.sleep(0.0002)
    work.wait()
    synchronize(device)


def flat_broadcast(args: argparse.Namespace, rank: int, port: int, nbytes: int) -> dict[str, float]:
    """One flat buffer of ``nbytes`` broadcast from rank 0 over a group formed as a session forms its own:
    the first broadcast (which forms NCCL's communicator) apart, then the median of ``FLOOR_REPS``."""
    from refitkit.transfer._broadcast import group as grp

    device = device_of(args, rank)
    store = grp.connect_store("127.0.0.1", port, is_master=rank == 0, timeout_s=args.timeout_s)
    began = time.perf_counter()
    group = grp.form_group(store, "flat", rank, args.receivers + 1, args.backend, args.timeout_s)
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    finish(grp.broadcast(group, buffer[:256]), device, args.timeout_s, "the floor's first broadcast")
    first_s = time.perf_counter() - began
    times = []
    for _ in range(FLOOR_REPS):
        start = time.perf_counter()
        finish(grp.broadcast(group, buffer), device, args.timeout_s, "the flat broadcast")
        times.append(time.perf_counter() - start)
    # the root's broadcast may finish before the others': it keeps the group (and hosts the store) until they did
    if rank:
        grp.put(store, f"flat/done/{rank}", b"1")
    else:
        grp.wait_until(
            lambda: all(grp.has(store, f"flat/done/{r}") for r in range(1, args.receivers + 1)),
            deadline=time.monotonic() + args.timeout_s,
            on_timeout=lambda: TimeoutError("a receiver did not finish the flat broadcast"),
        )
    group.shutdown()
    return {"group_s": first_s, "seconds": statistics.median(times)}


def peer_copy(device: torch.device, nbytes: int) -> dict[str, Any]:
    """``copy_`` of ``nbytes`` from the sender's GPU to GPU 1 (peer to peer), median of ``FLOOR_REPS``."""
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        peer = torch.device("cuda", 1)
    else:
        peer = device  # the CPU smoke run: a host memcpy
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=peer)
    dst.copy_(src)
    synchronize(device, peer)
    times = []
    for _ in range(FLOOR_REPS):
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device, peer)
        times.append(time.perf_counter() - start)
    return {"copy": f"copy_ {device} -> {peer}", "copy_gbps": nbytes / statistics.median(times) / 1e9}


def sender_main(config: dict, url: str, secret: str, commands: Any, answers: Any) -> None:
    from benchmarks.shapes import make_weights
    from refitkit.errors import TransferError
    from refitkit.transfer import BroadcastWeightSender

    args = argparse.Namespace(**config)
    device = device_of(args, 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    weights = make_weights(MODELS[args.model], device=device)
    nbytes = sum(tensor.nbytes for tensor in weights.values())
    sender = BroadcastWeightSender(
        url,
        secret=secret,
        receivers=args.receivers,
        bucket_bytes=int(args.bucket_mib * MIB),
        device=device,
        backend=args.backend,
        timeout_s=args.timeout_s,
        per_tensor=args.direct,
    )
    answers.put({"bytes": nbytes, "tensors": len(weights), "half_bytes": sender.half_bytes})
    while (command := commands.get()) is not None:
        if command[0] == "floor":
            copied = peer_copy(device, nbytes)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the copy's 2 x bytes (one on GPU 1) go back before the flat broadcast
            answers.put({**copied, **flat_broadcast(args, 0, command[1], nbytes)})
            continue
        version = command[1]
        touch(weights, version)
        want = digest(list(weights.values()))
        synchronize(device)
        sender.last_timings_s.pop("group", None)
        start = time.perf_counter()
        error = None
        try:
            stats = sender.send(((name, tensor) for name, tensor in weights.items()), version=version)
            buckets = stats.buckets
        except Exception as exc:  # the kill case: reported, not raised
            error, buckets = [type(exc).__name__, str(exc), isinstance(exc, TransferError)], None
        seconds = time.perf_counter() - start
        answers.put(
            {
                "seconds": seconds,
                "group_s": sender.last_timings_s.get("group"),
                "digest": want,
                "error": error,
                "buckets": buckets,
            }
        )


def receiver_main(config: dict, rank: int, url: str, secret: str, commands: Any, answers: Any) -> None:
    from refitkit.transfer import BroadcastWeightReceiver

    args = argparse.Namespace(**config)
    device = device_of(args, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    params = {
        name: torch.zeros(shape, dtype=torch.bfloat16, device=device)
        for name, shape in weight_shapes(MODELS[args.model])
    }
    nbytes = sum(tensor.nbytes for tensor in params.values())
    receiver = BroadcastWeightReceiver(
        url, secret=secret, rank=rank, device=device, backend=args.backend, timeout_s=args.timeout_s
    )
    answers.put({"pid": os.getpid()})
    while (command := commands.get()) is not None:
        if command[0] == "floor":
            answers.put(flat_broadcast(args, rank, command[1], nbytes))
            continue
        _, version, kill_at = command
        seen = [0]

        def on_bucket(weights: list[tuple[str, torch.Tensor]], last: bool) -> None:
            if seen[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # dies mid-sync, in the middle of the stream
            for name, tensor in weights:
                params[name].copy_(tensor)
            seen[0] += 1

        direct = (lambda name, dtype, shape: params.get(name)) if args.direct else None
        start = time.perf_counter()
        error = None
        try:
            receiver.receive(on_bucket, direct=direct)
        except Exception as exc:
            error = [type(exc).__name__, str(exc)]
        synchronize(device)
        seconds = time.perf_counter() - start
        split = receiver.last_direct
        answers.put(
            {
                "seconds": seconds,
                "error": error,
                "digest": digest(list(params.values())),
                "version": [receiver.weights_version.version, receiver.weights_version.incomplete],
                "direct_share": split.direct_share if split is not None else 0.0,
            }
        )


class Peer:
    """One spawned process and its two queues; every answer is awaited with a bound and a liveness check."""

    def __init__(self, ctx: Any, name: str, target: Any, *args: Any) -> None:
        self.name = name
        self.commands, self.answers = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=target, args=(*args, self.commands, self.answers), daemon=True)
        self.process.start()
        self.ready = self.answer(SPAWN_TIMEOUT_S)

    def answer(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.answers.get(timeout=0.5)
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(
                        f"{self.name} (pid {self.process.pid}) died with exit code {self.process.exitcode}"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} gave no answer within {timeout_s:g} s") from None

    def close(self) -> None:
        if self.process.is_alive():
            self.commands.put(None)
            self.process.join(30)
        if self.process.is_alive():  # our own child, by its pid
            self.process.kill()
            self.process.join(10)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Run:
    """The spawned sender and receivers of one benchmark run, and the syncs between them."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.ctx = args, mp.get_context("spawn")
        self.url, self.secret, self.config = f"tcp://127.0.0.1:{free_port()}", secrets.token_hex(16), vars(args)
        self.receivers: dict[int, Peer] = {}
        for rank in range(1, args.receivers + 1):
            self.spawn_receiver(rank)
        self.sender = Peer(self.ctx, "the sender", sender_main, self.config, self.url, self.secret)
        self.nbytes = self.sender.ready["bytes"]
        self.version = 0
        self.answer_s = 3 * args.timeout_s + 120  # a session's waits are bounded by timeout_s each

    def spawn_receiver(self, rank: int) -> None:
        self.receivers[rank] = Peer(
            self.ctx, f"receiver rank {rank}", receiver_main, self.config, rank, self.url, self.secret
        )

    def close(self) -> None:
        for peer in (self.sender, *self.receivers.values()):
            peer.close()

    def sync(self, kill_at: int | None = None) -> dict[str, Any]:
        self.version += 1
        for rank, peer in self.receivers.items():
            peer.commands.put(("sync", self.version, kill_at if rank == 1 else None))
        self.sender.commands.put(("sync", self.version))
        sent = self.sender.answer(self.answer_s)
        got = {
            rank: peer.answer(self.answer_s)
            for rank, peer in self.receivers.items()
            if not (kill_at is not None and rank == 1)
        }
        seconds = sent["seconds"]
        record: dict[str, Any] = {"version": self.version, "ms": 1e3 * seconds, "gbps": self.nbytes / seconds / 1e9}
        if sent["group_s"] is not None:
            record["group_ms"] = 1e3 * sent["group_s"]
            record["stream_gbps"] = self.nbytes / max(seconds - sent["group_s"], 1e-9) / 1e9
        record["buckets"] = sent["buckets"]
        record["error"] = sent["error"]
        record["receivers"] = {
            rank: {
                "ms": 1e3 * a["seconds"],
                "error": a["error"],
                "version": a["version"],
                "direct_share": a["direct_share"],
            }
            for rank, a in got.items()
        }
        record["intact"] = sent["error"] is None and all(
            a["error"] is None and a["digest"] == sent["digest"] for a in got.values()
        )
        return record

    def floor(self) -> dict[str, Any]:
        port = free_port()
        self.sender.commands.put(("floor", port))
        for peer in self.receivers.values():
            peer.commands.put(("floor", port))
        mine = self.sender.answer(self.answer_s)
        slowest = max([mine["seconds"], *(peer.answer(self.answer_s)["seconds"] for peer in self.receivers.values())])
        return {**mine, "flat_bcast_gbps": self.nbytes / slowest / 1e9}

    def kill_case(self, bucket: int) -> dict[str, Any]:
        args = self.args
        failed = self.sync(kill_at=bucket)
        victim = self.receivers[1].process
        victim.join(args.timeout_s + args.slack_s)
        error = failed["error"] or ["none", "send() succeeded: the receiver did not die (fewer buckets than K?)", False]
        bound_s = args.timeout_s + args.slack_s
        kill = {
            "bucket": bucket,
            "error_type": error[0],
            "message": error[1],
            "seconds": failed["ms"] / 1e3,
            "bound_s": bound_s,
            "victim_exitcode": victim.exitcode,
            "others": {rank: r["error"][0] if r["error"] else None for rank, r in failed["receivers"].items()},
            "others_version": {rank: r["version"] for rank, r in failed["receivers"].items()},
        }
        kill["names_phase_bucket_peer"] = all(word in error[1] for word in ("bucket", "receiver rank")) and any(
            phase in error[1] for phase in ("handshake", "streaming", "draining")
        )
        kill["ok"] = bool(error[2]) and kill["names_phase_bucket_peer"] and kill["seconds"] <= bound_s
        kill["ok"] = kill["ok"] and victim.exitcode == -signal.SIGKILL
        self.receivers.pop(1).close()
        began = time.perf_counter()
        self.spawn_receiver(1)
        kill["restart_s"] = time.perf_counter() - began
        kill["next_session"] = self.sync()
        kill["ok"] = kill["ok"] and kill["next_session"]["intact"]
        return kill


def summarize(result: dict[str, Any]) -> None:
    floor, rounds = result["floor"], result["rounds"]
    for r in rounds:
        r["vs_flat_bcast"] = r["gbps"] / floor["flat_bcast_gbps"]
        r["vs_copy"] = r["gbps"] / floor["copy_gbps"]
    steady = rounds[1:] or rounds
    result["steady"] = {
        key: statistics.median(r[key] for r in steady) for key in ("ms", "gbps", "vs_flat_bcast", "vs_copy")
    }


def print_table(result: dict[str, Any]) -> None:
    a, floor = result["args"], result["floor"]
    print(
        f"broadcast_sync: {result['model']} shapes, {result['bytes'] / 1e9:.2f} GB bf16 in {result['tensors']} tensors, "
        f"{a['backend']}, sender on {result['sender_device']} -> {a['receivers']} receiver(s), bucket halves of "
        f"{result['half_bytes'] / MIB:g} MiB{', direct receive' if a['direct'] else ''}"
    )
    print(
        f"same-run floor: {floor['copy']} {floor['copy_gbps']:.1f} GB/s; flat {a['backend']} broadcast of one buffer of "
        f"the same size {floor['flat_bcast_gbps']:.1f} GB/s (its group and first broadcast: {1e3 * floor['group_s']:.0f} ms)"
    )
    print(
        f"{'sync':>4} {'ms':>9} {'group ms':>9} {'GB/s':>7} {'stream GB/s':>12} {'/flat bcast':>12} {'/copy':>7}  intact"
    )
    for r in result["rounds"]:
        print(
            f"{r['version']:>4} {r['ms']:9.1f} {r.get('group_ms', float('nan')):9.1f} {r['gbps']:7.2f} "
            f"{r.get('stream_gbps', float('nan')):12.2f} {r['vs_flat_bcast']:12.2f} {r['vs_copy']:7.2f}  {r['intact']}"
        )
    s = result["steady"]
    print(
        f"steady (median of syncs 2..): {s['ms']:.1f} ms, {s['gbps']:.2f} GB/s, {s['vs_flat_bcast']:.2f}x the flat "
        f"broadcast, {s['vs_copy']:.2f}x the copy"
    )
    kill = result.get("kill")
    if kill and "crash" in kill:
        print(f"kill case FAILED: {kill['crash']}")
    elif kill:
        nxt = kill["next_session"]
        print(
            f"kill: receiver rank 1 SIGKILLed at bucket {kill['bucket']} (exit code {kill['victim_exitcode']}): the sender "
            f"ended in {kill['error_type']} after {kill['seconds']:.2f} s (bound {kill['bound_s']:g} s); other "
            f"receivers: {kill['others']}\n  {kill['message']}"
        )
        print(
            f"restart: receiver respawned in {kill['restart_s']:.1f} s; the next session {nxt['ms']:.1f} ms, intact "
            f"{nxt['intact']}; kill case {'OK' if kill['ok'] else 'FAILED'}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="8b")
    parser.add_argument("--receivers", type=int, default=1, help="engine processes, on GPUs 1..N")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--rounds", type=int, default=5, help="syncs, each a new session")
    parser.add_argument("--bucket-mib", type=float, default=512.0, help="the sender's bucket_bytes (two halves)")
    parser.add_argument("--direct", action="store_true", help="per_tensor sender; receivers land weights in place")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="timeout_s of both sides")
    parser.add_argument("--slack-s", type=float, default=5.0, help="the kill case's bound is timeout_s + this")
    parser.add_argument("--kill-receiver-at-bucket", type=int, default=None, metavar="K")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    if args.backend == "nccl" and args.device != "cuda":
        parser.error("--backend nccl needs --device cuda (use --backend gloo --device cpu for a CPU run)")
    if args.device == "cuda" and torch.cuda.device_count() < args.receivers + 1:
        parser.error(
            f"{args.receivers} receiver(s) on their own GPUs need {args.receivers + 1} GPUs; "
            f"{torch.cuda.device_count()} visible"
        )
    run = Run(args)
    try:
        result: dict[str, Any] = {
            "args": vars(args) | {"json": str(args.json)},
            "model": MODELS[args.model].name,
            "bytes": run.nbytes,
            "tensors": run.sender.ready["tensors"],
            "half_bytes": run.sender.ready["half_bytes"],
            "sender_device": str(device_of(args, 0)),
        }
        result["rounds"] = [run.sync() for _ in range(args.rounds)]
        result["floor"] = run.floor()
        summarize(result)
        if args.kill_receiver_at_bucket is not None:
            try:
                result["kill"] = run.kill_case(args.kill_receiver_at_bucket)
            except (RuntimeError, TimeoutError) as exc:  # e.g. NCCL's watchdog took the sender down: keep the figures
                result["kill"] = {"ok": False, "crash": f"{type(exc).__name__}: {exc}"}
    finally:
        run.close()
    print_table(result)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    ok = all(r["intact"] for r in result["rounds"]) and result.get("kill", {"ok": True})["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
