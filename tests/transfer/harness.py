"""One round trip through a real sender (this process) and a real receiver (spawned process)."""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from refitkit.transfer import BucketedWeightSender, TransferStats
from tests.helpers import procs
from tests.transfer.peers import ReceiverServer, digest, mapped_segments, one_shot_receiver_main


@dataclass(frozen=True)
class Case:
    transport: str
    tensor_device: str
    receiver_device: str

    def __str__(self) -> str:
        return f"{self.transport}-{self.tensor_device}-to-{self.receiver_device}"


CASES = [
    pytest.param(Case("shm", "cpu", "cpu"), id="shm-cpu"),
    pytest.param(Case("cuda_ipc", "cuda", "cuda"), id="cuda_ipc", marks=pytest.mark.cuda),
    pytest.param(Case("shm", "cuda", "cuda"), id="shm-cuda", marks=pytest.mark.cuda),
]


MIB = 1 << 20
# Device memory comes and goes in whole 2 MiB pages (a cuda_ipc bucket is rounded up to them; torch's
# segments are multiples of them): any leaked bucket or block is at least one page, and a change of
# less than a page is not an allocation. Hence "back to baseline" means: less than one page missing.
PAGE_BYTES = 2 * MIB


def spawn(target, *args) -> tuple[Any, Any]:
    """Start ``target(*args, conn)`` in a spawned (daemon) process; returns it and our end of its pipe."""
    ctx = procs.context()
    parent, child = ctx.Pipe()
    process = ctx.Process(target=target, args=(*args, child), daemon=True)
    process.start()
    return process, parent


def device_free_bytes() -> int:
    """The GPU's free memory as the driver counts it: unlike ``memory_reserved()`` it sees a bucket from
    ``cuMemAlloc`` (outside torch's allocator) and every process on the device (the receiver's too)."""
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def assert_device_memory_back(baseline_free: int, after: str, *, settle_s: float = 0.0) -> None:
    """The device's free memory is back to ``baseline_free`` (less than a page missing). ``settle_s``: how long
    the driver may take to tear down a killed process's context (only then does its memory come back)."""
    deadline = time.monotonic() + settle_s
    missing = baseline_free - device_free_bytes()
    while missing >= PAGE_BYTES and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the driver's teardown of a dead process, not waiting on our own code
        missing = baseline_free - device_free_bytes()
    assert missing < PAGE_BYTES, (
        f"{after}: {missing / MIB:.1f} MiB of device memory not given back (baseline of this test); {device_holders()}"
    )


def device_holders() -> str:
    """Who holds device memory, for a failure message: this process's torch allocator, and each process the driver
    lists (NVML, where it is installed)."""
    held = f"pid {os.getpid()} torch reserved {torch.cuda.memory_reserved() / MIB:.1f} MiB"
    try:
        import pynvml
    except ImportError:
        return held
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        users = ", ".join(
            f"pid {p.pid} {(p.usedGpuMemory or 0) / MIB:.1f} MiB"
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        )
    finally:
        pynvml.nvmlShutdown()
    return f"{held}; the driver's list: {users or 'none'}"


def own_segment_files() -> list[str]:
    """This process's shared-memory segments: named files, and memfds it still holds a descriptor of (a finished
    send leaves none)."""
    named = glob.glob(f"/dev/shm/refitkit-{os.getuid()}-{os.getpid()}-*")
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, closed by now
        if target.startswith("/memfd:refitkit-"):
            held.append(target)
    return named + held


def roundtrip(
    server: ReceiverServer,
    endpoint: str,
    weights: Any,
    *,
    bucket_bytes: int = 64 << 10,
    case: Case = Case("shm", "cpu", "cpu"),
    mode: str = "collect",
    timeout_s: float = 10.0,
    expected: dict[str, Any] | None = None,
    generator: bool = False,
    direct: bool = False,
) -> tuple[TransferStats, dict[str, Any]]:
    """Send ``weights`` and check the receiver got every tensor bit-exactly and both sides released.

    ``generator``: send them as a generator (a list is sent as is: its buffer is sized to it, and its
    small tensors are batched; a generator gets halves of exactly ``bucket_bytes // 2``). ``direct``: the
    sender's ``direct=True``; its ``last_split`` is in the returned result as ``split``."""
    if expected is None:
        expected = {name: digest(tensor) for name, tensor in weights}
    with BucketedWeightSender(
        endpoint, bucket_bytes=bucket_bytes, transport=case.transport, timeout_s=timeout_s, direct=direct
    ) as sender:
        server.start_session(endpoint, device=case.receiver_device, timeout_s=timeout_s, mode=mode)
        stats = sender.send((item for item in weights) if generator else weights)
        assert own_segment_files() == [] and mapped_segments() == []  # sender holds no bucket memory
    result = server.result()
    result["split"], result["timings"] = sender.last_split, dict(sender.last_timings_s)
    assert result["ok"], result
    assert result["digests"] == expected
    assert result["segments_after"] == []  # receiver unmapped before it returned
    assert stats.tensors == len(expected)
    assert stats.bytes == sum(
        torch.Size(shape).numel() * torch.empty(0, dtype=getattr(torch, dtype[6:])).element_size()
        for dtype, shape, _ in expected.values()
    )
    return stats, result


@contextmanager
def receiver_killed_at(
    endpoint: str, bucket: int, *, device: str, timeout_s: float, mode: str = "kill"
) -> Iterator[int]:
    """A receiver in its own process (its pid is the block's value) that SIGKILLs itself in its ``bucket``-th
    on_bucket call (reading nothing on its way, so a test that times the sender times no digests); it is about to
    say hello when the block starts, and it must have died by SIGKILL when the block ends."""
    ctx = procs.context()
    parent, child = ctx.Pipe()
    victim = ctx.Process(target=one_shot_receiver_main, args=(endpoint, device, timeout_s, mode, bucket, child))
    victim.start()
    try:
        assert parent.poll(60) and parent.recv() == "starting"
        yield victim.pid
    finally:
        victim.join(30)
    assert victim.exitcode == -9
