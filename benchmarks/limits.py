"""Hardware limits measured in the same run as a benchmark: the denominators of every ratio we report."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CopyLimits:
    """Flat copy rates of one GPU, decimal GB/s, each the best of a few repetitions."""

    nbytes: int
    pinned_d2h_gbps: float
    pinned_h2d_gbps: float
    d2d_gbps: float  # bytes copied per second (read + write would be twice this)


def _best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def exact_pinned_buffer(nbytes: int) -> torch.Tensor:
    """A host buffer of exactly ``nbytes``, page-locked with cudaHostRegister (what HostArena uses)."""
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    status = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)
    if int(status) != 0:  # not an assert: it would vanish under python -O and the copy would run unpinned
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {status} (ulimit -l too low?)")
    return buffer


def unpin(buffer: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


def measure_copy_limits(nbytes: int, *, repeats: int = 3) -> CopyLimits:
    """One flat D2H, H2D (pinned) and D2D copy of ``nbytes``: the rates our moves are held to."""
    device_buffer = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host_buffer = exact_pinned_buffer(nbytes)
    try:
        d2h = _best_seconds(lambda: host_buffer.copy_(device_buffer, non_blocking=True), repeats)
        h2d = _best_seconds(lambda: device_buffer.copy_(host_buffer, non_blocking=True), repeats)
        other = torch.empty_like(device_buffer)
        d2d = _best_seconds(lambda: other.copy_(device_buffer), repeats)
        del other
    finally:
        unpin(host_buffer)
    del device_buffer
    torch.cuda.empty_cache()
    return CopyLimits(nbytes, nbytes / d2h / 1e9, nbytes / h2d / 1e9, nbytes / d2d / 1e9)
