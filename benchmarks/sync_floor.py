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
Compare with ``weight_sync.py --sources generator --loaders per-tensor`` run right before. The weights
change every round, and each round's parameters are checked against them outside the timed window
(``intact``). Every wait is bounded by ``--timeout-s``; a peer that dies opens the counters' waits.

What it is and is not: the kept bucket (``persistent``) is the floor of the copies and the hand-offs
between two processes on one GPU; the per-sync contract costs what allocating, mapping, unmapping and
freeing cost here, which for small models is more than refitkit's own setup and free phases (there
refitkit is faster than ``contract``, so that column is no floor for them).

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
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a source checkout

from benchmarks.shapes import QWEN3_0_6B, QWEN3_8B, weight_shapes  # noqa: E402

MODELS = {"0.6b": QWEN3_0_6B, "8b": QWEN3_8B}
_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
_DEVICEMAP = 0x2  # CU_MEMHOSTREGISTER_DEVICEMAP
_PACKED, _CONSUMED = 0, 64  # byte offsets of the two counters in the shared page (own cache lines)
_OPEN = 1 << 30  # a counter value no wait of a benchmark run reaches


class _Counters:
    """Two 32-bit counters in a shared page, registered with this process's CUDA context."""

    def __init__(self, path: str) -> None:
        from refitkit.transfer._ipc.cuda_ipc import _driver

        self.lib = _driver()
        fd = os.open(path, os.O_RDWR)
        self.mapping = mmap.mmap(fd, mmap.PAGESIZE)
        os.close(fd)
        self.anchor = ctypes.c_char.from_buffer(self.mapping)
        host = ctypes.addressof(self.anchor)
        torch.cuda.current_stream().synchronize()  # the primary context is current on this thread
        self._call(
            "cuMemHostRegister_v2", ctypes.c_void_p(host), ctypes.c_size_t(mmap.PAGESIZE), ctypes.c_uint(_DEVICEMAP)
        )
        device = ctypes.c_uint64()
        self._call("cuMemHostGetDevicePointer_v2", ctypes.byref(device), ctypes.c_void_p(host), ctypes.c_uint(0))
        self.host, self.device = host, device.value

    def _call(self, name: str, *args) -> None:
        from refitkit.transfer._ipc.cuda_ipc import _check

        _check(self.lib, getattr(self.lib, name)(*args), name)

    def write_after(self, which: int, value: int) -> None:
        """Set counter ``which`` to ``value`` once the current stream's earlier work is done."""
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._call(
            "cuStreamWriteValue32_v2",
            stream,
            ctypes.c_uint64(self.device + which),
            ctypes.c_uint32(value),
            ctypes.c_uint(0),
        )

    def wait_before(self, which: int, value: int) -> None:
        """The current stream's later work waits until counter ``which`` is at least ``value``."""
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._call(
            "cuStreamWaitValue32_v2",
            stream,
            ctypes.c_uint64(self.device + which),
            ctypes.c_uint32(value),
            ctypes.c_uint(_WAIT_GEQ),
        )

    def open_all(self) -> None:
        """Set both counters past any value a wait asks for, from the CPU: a stream still waiting (on a
        peer that died or fell behind a timeout) runs on, so the process can synchronize and exit. The
        driver's GEQ is cyclic (``(int32_t)(*addr - value) >= 0``), so "past" is 2**30, not 2**32 - 1."""
        for which in (_PACKED, _CONSUMED):
            ctypes.c_uint32.from_address(self.host + which).value = _OPEN

    def settle(self, timeout_s: float, what: str) -> None:
        """Wait, bounded, for the current stream's work; past the deadline open every wait and raise."""
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                self.open_all()
                torch.cuda.current_stream().synchronize()  # bounded now: no wait is left closed
                raise TimeoutError(
                    f"sync_floor: {what} did not finish within --timeout-s={timeout_s} (peer dead or stuck?)"
                )

    def close(self) -> None:
        self.open_all()
        torch.cuda.synchronize()  # bounded: every wait is open
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


def _recv_json(conn, what: str, timeout_s: float):
    if not conn.poll(timeout_s):
        raise TimeoutError(f"sync_floor: no {what} from the peer within --timeout-s={timeout_s}")
    return json.loads(conn.recv_bytes())


def digests(tensors: list[torch.Tensor]) -> list[int]:
    """weight_sync.py's checksum per tensor (outside the timed window)."""
    from benchmarks.weight_sync import checksums

    return checksums([("", t) for t in tensors])


def receiver_main(counters_path: str, shapes: list, half_bytes: int, rounds: int, timeout_s: float, conn) -> None:
    torch.cuda.set_device(0)
    params = [torch.empty(shape, dtype=torch.bfloat16, device="cuda") for _, shape in shapes]
    layout = plan(shapes, half_bytes)
    counters = _Counters(counters_path)
    try:
        conn.send_bytes(b"{}")
        _receive(counters, params, layout, half_bytes, rounds, timeout_s, conn)
    finally:
        counters.close()


def _receive(
    counters: _Counters, params: list, layout: list, half_bytes: int, rounds: int, timeout_s: float, conn
) -> None:
    from refitkit.transfer._ipc.cuda_ipc import CudaIpcMapping

    flat_params = [p.view(-1).view(torch.uint8) for p in params]
    mapping = None
    for round_ in range(rounds):
        msg = _recv_json(conn, "bucket handle", timeout_s)
        if msg.get("handle") is not None:
            mapping = CudaIpcMapping(
                {**msg["handle"], "ipc_handle": bytes.fromhex(msg["handle"]["ipc_handle"])}, torch.device("cuda", 0)
            )
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
        counters.settle(timeout_s, "the receiver's copies")
        if msg["release"]:
            mapping.release()  # synchronize, close, ipc_collect, empty_cache: what refitkit's receiver does
            mapping = None
        conn.send_bytes(b'{"released": true}')
        conn.send_bytes(json.dumps({"digest": digests(params)}).encode())  # after the timed window
        if mapping is not None and round_ == rounds - 1:
            mapping.release()  # a kept bucket's mapping goes after the last round, untimed


def _send(
    counters: _Counters,
    conn,
    weights: list,
    layout: list,
    half: int,
    bucket_bytes: int,
    mode: str,
    rounds: int,
    timeout_s: float,
):
    """Returns the sync times and whether every round's parameters matched that round's weights."""
    from refitkit.transfer._ipc.cuda_ipc import CudaIpcBucket

    device = torch.device("cuda", 0)
    times, bucket, buckets, intact, flat = [], None, layout[-1][-1][0] + 1, True, None
    try:
        for round_ in range(rounds):
            base = round_ * buckets
            t0 = time.perf_counter()
            fresh = bucket is None
            if fresh:
                bucket = CudaIpcBucket(bucket_bytes, device=device)
            handle = bucket.handle()
            conn.send_bytes(
                json.dumps(
                    {
                        "handle": {**handle, "ipc_handle": handle["ipc_handle"].hex()} if fresh else None,
                        "base": base,
                        "release": mode == "contract",
                    }
                ).encode()
            )
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
            flat = None
            _recv_json(conn, "release", timeout_s)
            if mode == "contract":
                bucket.free()  # synchronizes our stream: bounded, the receiver consumed every bucket
                bucket = None
            else:
                counters.settle(timeout_s, "the sender's copies")
            times.append(time.perf_counter() - t0)
            # Outside the timed window: this round's weights arrived whole, and the next round's differ, so a
            # half read before it was packed (or overwritten before it was read) shows as a mismatch.
            intact &= _recv_json(conn, "digest", timeout_s)["digest"] == digests(weights)
            for w in weights:
                w.add_(1)
            counters.settle(timeout_s, "changing the weights")  # or the next round's copies would queue behind it
    finally:
        flat = None
        if bucket is not None:
            counters.open_all()  # a receiver that died leaves no stream of ours waiting
            bucket.free()
    return times, intact


def bench(model: str, mode: str, rounds: int, warmup: int, bucket_bytes: int, timeout_s: float) -> dict:
    shapes = weight_shapes(MODELS[model])
    half = bucket_bytes // 2
    layout = plan(shapes, half)
    weights = [torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _, shape in shapes]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    fd, path = tempfile.mkstemp(prefix="refitkit-floor-", dir="/dev/shm")
    peer, counters = None, None
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        os.close(fd)
        fd = -1
        peer = ctx.Process(target=receiver_main, args=(path, shapes, half, rounds + warmup, timeout_s, child))
        peer.start()
        counters = _Counters(path)
        _recv_json(parent, "ready", timeout_s)
        times, intact = _send(counters, parent, weights, layout, half, bucket_bytes, mode, rounds + warmup, timeout_s)
        peer.join(timeout_s)
    finally:
        if fd >= 0:
            os.close(fd)
        os.unlink(path)
        if counters is not None:
            counters.close()
        if peer is not None and peer.is_alive():
            peer.kill()
            peer.join(10)
    steady = times[warmup:]
    return {
        "median_ms": statistics.median(steady) * 1e3,
        "min_ms": min(steady) * 1e3,
        "buckets": layout[-1][-1][0] + 1,
        "bytes": sum(w.numel() * 2 for w in weights),
        "tensors": len(weights),
        "intact": intact,
        "exit": peer.exitcode,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="0.6b,8b")
    parser.add_argument("--modes", default="contract,persistent")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--bucket-gib", type=float, default=2.0)
    parser.add_argument("--timeout-s", type=float, default=60.0, help="bound on every wait for the peer")
    args = parser.parse_args()
    from benchmarks.weight_sync import d2d_copy_gbps

    rate = d2d_copy_gbps()
    print(f"D2D copy {rate:.0f} GB/s")
    print(
        f"{'model':>6} {'mode':>11} {'GB':>6} {'tensors':>7} {'buckets':>7} {'median ms':>10} {'min ms':>7} {'2 copies ms':>12} {'intact':>6}"
    )
    for model in args.models.split(","):
        for mode in args.modes.split(","):
            r = bench(model, mode, args.rounds, args.warmup, int(args.bucket_gib * (1 << 30)), args.timeout_s)
            floor = 2 * r["bytes"] / rate / 1e6
            print(
                f"{model:>6} {mode:>11} {r['bytes'] / 1e9:6.2f} {r['tensors']:7d} {r['buckets']:7d} {r['median_ms']:10.1f} "
                f"{r['min_ms']:7.1f} {floor:12.1f} {str(r['intact'] and r['exit'] == 0):>6}"
            )


if __name__ == "__main__":
    main()
