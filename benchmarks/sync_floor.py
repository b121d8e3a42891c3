"""The floor of a two-process weight sync on one GPU (GPU only): the same copies as refitkit's, no protocol.

What a sync must do under DESIGN's rules, stripped of everything else: a sender process copies each
tensor of a *generator* (one ``copy_`` per item, split at half boundaries) into one half of a 2 GiB
driver-allocated bucket; a receiver process on the same GPU copies each piece into its own parameter
(one ``copy_`` per piece, as vLLM's default loader does); the two halves alternate. Both sides know the
layout ahead, so no metadata travels, nothing is validated and no Python thread waits between buckets:
every hand-off is a GPU stream memory operation on a counter in shared host memory
(``cuStreamWriteValue32`` after a side's copies, ``cuStreamWaitValue32`` before the other side's), so each
process queues its whole sync at once and the GPU switches between them as soon as a counter moves.

Modes (each the median of ``--rounds`` after ``--warmup``, timed on the sender from the bucket's
allocation to its free):

- ``contract``: the bucket is allocated, exported, mapped, unmapped and freed every sync (what
  DESIGN's bucket contract requires: 0 bytes held after ``send()``);
- ``persistent``: one bucket and mapping for all rounds (what the contract forbids), for scale.

Also printed: this GPU's D2D copy rate, and the time the two copies of every byte take at it.
Compare with ``weight_sync.py --sources generator --loaders per-tensor`` run right before.

    python benchmarks/sync_floor.py [--models 0.6b,8b] [--modes contract,persistent] [--rounds 10] [--warmup 2]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import statistics
import tempfile
import time

import torch

from refitkit.shapes import QWEN3_0_6B, QWEN3_8B, weight_shapes

MODELS = {"0.6b": QWEN3_0_6B, "8b": QWEN3_8B}
_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
_DEVICEMAP = 0x2  # CU_MEMHOSTREGISTER_DEVICEMAP
_PACKED, _CONSUMED = 0, 64  # byte offsets of the two counters in the shared page (own cache lines)


class _Counters:
    """Two 32-bit counters in a shared page, registered with this process's CUDA context."""

    def __init__(self, path: str) -> None:
        from refitkit.transfer.cuda_ipc import _driver

        self.lib = _driver()
        fd = os.open(path, os.O_RDWR)
        self.mapping = mmap.mmap(fd, mmap.PAGESIZE)
        os.close(fd)
        self.anchor = ctypes.c_char.from_buffer(self.mapping)
        host = ctypes.addressof(self.anchor)
        torch.cuda.current_stream().synchronize()  # the primary context is current on this thread
        self._call("cuMemHostRegister_v2", ctypes.c_void_p(host), ctypes.c_size_t(mmap.PAGESIZE), ctypes.c_uint(_DEVICEMAP))
        device = ctypes.c_uint64()
        self._call("cuMemHostGetDevicePointer_v2", ctypes.byref(device), ctypes.c_void_p(host), ctypes.c_uint(0))
        self.host, self.device = host, device.value

    def _call(self, name: str, *args) -> None:
        result = getattr(self.lib, name)(*args)
        if result != 0:
            raise RuntimeError(f"{name} failed: CUDA error {result}")

    def write_after(self, which: int, value: int) -> None:
        """Set counter ``which`` to ``value`` once the current stream's earlier work is done."""
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._call("cuStreamWriteValue32_v2", stream, ctypes.c_uint64(self.device + which), ctypes.c_uint32(value), ctypes.c_uint(0))

    def wait_before(self, which: int, value: int) -> None:
        """The current stream's later work waits until counter ``which`` is at least ``value``."""
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._call("cuStreamWaitValue32_v2", stream, ctypes.c_uint64(self.device + which), ctypes.c_uint32(value), ctypes.c_uint(_WAIT_GEQ))

    def open_all(self) -> None:
        """Set both counters past any value a wait asks for, from the CPU: a stream still waiting (on a
        peer that died or fell behind a timeout) runs on, so the process can synchronize and exit."""
        for which in (_PACKED, _CONSUMED):
            ctypes.c_uint32.from_address(self.host + which).value = 0xFFFFFFFF

    def close(self) -> None:
        torch.cuda.synchronize()
        self._call("cuMemHostUnregister", ctypes.c_void_p(self.host))
        del self.anchor
        self.mapping.close()


def plan(shapes: list, half_bytes: int) -> list[list[tuple[int, int, int, int]]]:
    """Per tensor, its pieces: (bucket index, offset in the half, first byte, byte count)."""
    pieces, bucket, used = [], 0, 0
    for _, shape in shapes:
        nbytes, start, mine = 2 * int(torch.Size(shape).numel()), 0, []
        while start < nbytes:
            if used == half_bytes:
                bucket, used = bucket + 1, 0
            take = min(nbytes - start, half_bytes - used)
            mine.append((bucket, used, start, take))
            start, used = start + take, used + take
        pieces.append(mine)
    return pieces


def _recv_json(conn, what: str, timeout_s: float = 60.0):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"sync_floor: no {what} from the peer within {timeout_s} s")
    return json.loads(conn.recv_bytes())


def receiver_main(counters_path: str, shapes: list, half_bytes: int, rounds: int, conn) -> None:
    torch.cuda.set_device(0)
    params = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _, shape in shapes]
    layout = plan(shapes, half_bytes)
    counters = _Counters(counters_path)
    conn.send_bytes(b"{}")
    try:
        _receive(counters, params, layout, half_bytes, rounds, conn)
    finally:
        counters.open_all()
        counters.close()


def _receive(counters: _Counters, params: list, layout: list, half_bytes: int, rounds: int, conn) -> None:
    from refitkit.transfer.cuda_ipc import CudaIpcMapping

    flat_params = [p.view(-1).view(torch.uint8) for p in params]
    mapping = None
    for round_ in range(rounds):
        msg = _recv_json(conn, "bucket handle")
        if msg.get("handle") is not None:
            mapping = CudaIpcMapping({**msg["handle"], "ipc_handle": bytes.fromhex(msg["handle"]["ipc_handle"])}, torch.device("cuda", 0))
        base, current = msg["base"], -1
        flat = mapping.tensor
        for index, pieces in enumerate(layout):
            for bucket, offset, start, take in pieces:
                if bucket != current:
                    if current >= 0:
                        counters.write_after(_CONSUMED, base + current + 1)
                    current = bucket
                    counters.wait_before(_PACKED, base + bucket + 1)
                at = (bucket % 2) * half_bytes + offset
                flat_params[index][start : start + take].copy_(flat[at : at + take])
        counters.write_after(_CONSUMED, base + current + 1)
        del flat
        if msg["release"]:
            mapping.release()
            mapping = None
        else:
            torch.cuda.current_stream().synchronize()
        last = round_ == rounds - 1  # the digest only after the last round: it is not part of a sync
        digest = [int(p.view(torch.int16).sum(dtype=torch.int64)) for p in params] if last else None
        conn.send_bytes(json.dumps({"digest": digest}).encode())


def _send(counters: _Counters, conn, weights: list, layout: list, half: int, bucket_bytes: int, mode: str, rounds: int):
    from refitkit.transfer.cuda_ipc import CudaIpcBucket

    device = torch.device("cuda", 0)
    times, bucket, buckets, digest = [], None, layout[-1][-1][0] + 1, None
    try:
        for round_ in range(rounds):
            base = round_ * buckets
            t0 = time.perf_counter()
            fresh = bucket is None
            if fresh:
                bucket = CudaIpcBucket(bucket_bytes, device=device)
            handle = bucket.handle()
            conn.send_bytes(json.dumps({
                "handle": {**handle, "ipc_handle": handle["ipc_handle"].hex()} if fresh else None,
                "base": base, "release": mode == "contract",
            }).encode())  # fmt: skip
            flat, current = bucket.tensor, -1
            for index, tensor in enumerate(iter(weights)):  # item by item, as from a generator
                src = tensor.view(-1).view(torch.uint8)
                for piece, offset, start, take in layout[index]:
                    if piece != current:
                        if current >= 0:
                            counters.write_after(_PACKED, base + current + 1)
                        current = piece
                        if piece >= 2:
                            counters.wait_before(_CONSUMED, base + piece - 1)
                    at = (piece % 2) * half + offset
                    flat[at : at + take].copy_(src[start : start + take])
            counters.write_after(_PACKED, base + current + 1)
            del flat
            digest = _recv_json(conn, "release")["digest"]
            if mode == "contract":
                bucket.free()
                bucket = None
            else:
                torch.cuda.current_stream().synchronize()
            times.append(time.perf_counter() - t0)
    finally:
        if bucket is not None:
            counters.open_all()
            bucket.free()
    return times, digest, buckets


def bench(model: str, mode: str, rounds: int, warmup: int, bucket_bytes: int) -> dict:
    shapes = weight_shapes(MODELS[model])
    half = bucket_bytes // 2
    layout = plan(shapes, half)
    weights = [torch.randn(shape, device="cuda").to(torch.bfloat16) for _, shape in shapes]
    fd, path = tempfile.mkstemp(prefix="refitkit-floor-", dir="/dev/shm")
    os.ftruncate(fd, mmap.PAGESIZE)
    os.close(fd)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    peer = ctx.Process(target=receiver_main, args=(path, shapes, half, rounds + warmup, child))
    peer.start()
    counters = None
    try:
        counters = _Counters(path)
        _recv_json(parent, "ready")
        times, digest, buckets = _send(counters, parent, weights, layout, half, bucket_bytes, mode, rounds + warmup)
        peer.join(60)
    finally:
        os.unlink(path)
        if counters is not None:
            counters.open_all()  # a receiver that died leaves no stream of ours waiting
            counters.close()
        if peer.is_alive():
            peer.kill()
            peer.join(10)
    intact = digest == [int(w.view(torch.int16).sum(dtype=torch.int64)) for w in weights]
    steady = times[warmup:]
    return {"median_ms": statistics.median(steady) * 1e3, "min_ms": min(steady) * 1e3, "buckets": buckets,
            "bytes": sum(w.numel() * 2 for w in weights), "tensors": len(weights), "intact": intact, "exit": peer.exitcode}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="0.6b,8b")
    parser.add_argument("--modes", default="contract,persistent")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--bucket-gib", type=float, default=2.0)
    args = parser.parse_args()
    from benchmarks.weight_sync import d2d_copy_gbps

    rate = d2d_copy_gbps()
    print(f"D2D copy {rate:.0f} GB/s")
    print(f"{'model':>6} {'mode':>11} {'GB':>6} {'tensors':>7} {'buckets':>7} {'median ms':>10} {'min ms':>7} {'2 copies ms':>12} {'intact':>6}")
    for model in args.models.split(","):
        for mode in args.modes.split(","):
            r = bench(model, mode, args.rounds, args.warmup, int(args.bucket_gib * (1 << 30)))
            floor = 2 * r["bytes"] / rate / 1e6
            print(f"{model:>6} {mode:>11} {r['bytes'] / 1e9:6.2f} {r['tensors']:7d} {r['buckets']:7d} {r['median_ms']:10.1f} "
                  f"{r['min_ms']:7.1f} {floor:12.1f} {str(r['intact'] and r['exit'] == 0):>6}")  # fmt: skip


if __name__ == "__main__":
    main()
