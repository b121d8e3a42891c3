"""Device-level helpers: the one explicit sync point of a phase, and storage views."""

from __future__ import annotations

import os

import torch

# Where a storage's bytes start in host slots and buckets: every dtype view is then aligned, and copies coalesce
# (costs under 256 bytes a storage).
ALIGN_BYTES = 256


def align_up(nbytes: int) -> int:
    """``nbytes`` rounded up to ``ALIGN_BYTES``."""
    return (nbytes + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def flush_device(device: torch.device | str | int | None = None) -> None:
    """Wait for the device's queued work, then return its cached free blocks to the driver.

    This is the explicit replacement for the accidental sync that a full garbage collection gives peers:
    ``synchronize()`` then ``empty_cache()``. A no-op without CUDA.
    """
    if not torch.cuda.is_available():
        return
    if device is not None:
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if device.type != "cuda":
            return
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    """One synchronize for a phase's queued copies (CPU copies are already complete)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolved_device(device: torch.device) -> torch.device:
    """``device`` with its index: ``cuda`` alone means the current CUDA device (a tensor on it says ``cuda:0``)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def storage_as_bytes(storage: torch.UntypedStorage, nbytes: int | None = None) -> torch.Tensor:
    """A flat uint8 tensor over ``storage`` (no copy), for byte-exact moves of any dtype."""
    size = storage.nbytes() if nbytes is None else nbytes
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    flat.set_(storage, 0, (size,), (1,))
    return flat


def regrowable(storage: torch.UntypedStorage) -> bool:
    """Whether ``storage`` can be freed with ``resize_(0)`` and grown back in place.

    A CPU storage in shared memory (``share_memory_()``) claims to be resizable, but growing it back
    after ``resize_(0)`` crashes the process (segfault, torch 2.13): it counts as a fixed buffer.
    """
    return storage.resizable() and not (storage.device.type == "cpu" and storage.is_shared())


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that owns real storage: a DTensor's local shard, otherwise the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    if to_local is not None and type(tensor).__name__ == "DTensor":
        with torch.no_grad():
            return to_local()
    return tensor


# torch's caching allocator (c10/cuda/CUDACachingAllocator.cpp): requests above 1 MiB come from its large
# pool, each block rounded up to 512 bytes, and a free block is split to serve a smaller request.
_SMALL_REQUEST_BYTES = 1 << 20
_BLOCK_ROUND_BYTES = 512
REGROW_SEGMENT_BYTES = 2 << 30


class SegmentedRegrow:
    """Regrow storages (in the order given) into shared segments of at most ``segment_bytes`` each.

    After a flush every regrown storage above 1 MiB is its own ``cudaMalloc`` (an 8B model's
    state: ~600 segments), and the next flush pays a ``cudaFree`` for each. Before the first
    storage of each run of large ones that fit together in ``segment_bytes``, one block of their
    total is allocated and handed straight back to the cache; their regrows then split it. The
    segments stay small next to the whole, so the copies into the first of them start at once
    (one segment for everything made an 8B reload after a flush 37 ms slower on an H200: its copies
    waited for the driver to clear the whole just-freed range). Measured on an H200 (refit_cycle.py):
    an 8B model's flush 30-50 ms instead of 50-79 ms, its reload within noise; a 0.6B model's reload
    was slower in the runs measured (41 against 46 GB/s), not explained yet. A no-op on the CPU, with
    expandable segments (memory is mapped on demand there), or where the memory is not there in
    one piece, or while the cache still holds about half of it in free blocks (then each storage
    allocates as before).
    """

    def __init__(
        self, device: torch.device | None, sizes: list[int], *, segment_bytes: int = REGROW_SEGMENT_BYTES
    ) -> None:
        self._reserve_at: dict[int, int] = {}
        self.segments = 0
        if device is None or device.type != "cuda" or _expandable_segments():
            return
        self._device = device
        plan = segment_plan(sizes, segment_bytes)
        # without a flush since the storages were freed their old blocks are still cached, and the regrows take
        # those (best fit): a new segment would sit unused, holding device memory until the next flush
        cached_free = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        self._reserve_at = plan if cached_free < sum(plan.values()) // 2 else {}

    def before(self, index: int) -> None:
        """Call before regrowing the ``index``-th storage of ``sizes``."""
        nbytes = self._reserve_at.get(index)
        if nbytes is None:
            return
        if nbytes > torch.cuda.mem_get_info(self._device)[0]:
            return  # not there in one piece: no OOM report (users' OOM observers) for a shortcut
        try:
            block = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        except torch.OutOfMemoryError:
            return
        del block  # back to the cache as one free block on this stream; the next regrows split it
        self.segments += 1


def segment_plan(sizes: list[int], segment_bytes: int = REGROW_SEGMENT_BYTES) -> dict[int, int]:
    """index -> bytes to reserve before regrowing ``sizes[index]``: runs of consecutive large sizes (small ones
    come from the allocator's small pool and are skipped) that fit together in ``segment_bytes``, as the
    allocator rounds them; a size alone gets none (its own allocation is one segment anyway)."""
    plan: dict[int, int] = {}
    start, total, count = -1, 0, 0
    for index, nbytes in enumerate(sizes):
        if nbytes <= _SMALL_REQUEST_BYTES:
            continue
        rounded = -(-nbytes // _BLOCK_ROUND_BYTES) * _BLOCK_ROUND_BYTES
        if count and total + rounded <= segment_bytes:
            total, count = total + rounded, count + 1
        else:
            start, total, count = index, rounded, 1
        if count > 1:
            plan[start] = total
    return plan


def _expandable_segments() -> bool:
    return "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
