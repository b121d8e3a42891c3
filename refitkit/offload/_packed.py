"""Packed copies of small storages: one host<->device copy per run of back-to-back arena slots.

A copy of a few KiB costs about as much as its launch, so thousands of small storages (norm
weights, biases and their optimizer state) stay far below the flat copy rate. Slots reserved
together lie back to back in one host chunk; for such a run the device side is staged in one
buffer (one multi-tensor copy kernel) and the host side moves in one copy. The bytes that land in
each slot are exactly those of the per-storage copy; the alignment padding between slots belongs
to no slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from refitkit.offload.arena import HostArena, Slot, _align
from refitkit.offload.device import storage_as_bytes

if TYPE_CHECKING:
    from refitkit.offload.moves import _StorageGroup

RUN_MAX_BYTES = 64 << 20  # bounds the device staging buffer of one run

Run = list[tuple["_StorageGroup", Slot, int]]  # (group, slot, bytes to move)


def packed_runs(moves: Sequence[tuple["_StorageGroup", Slot, int]], *, below_bytes: int) -> tuple[list[Run], list]:
    """Runs of two or more storages under ``below_bytes`` whose slots lie back to back; and every other move."""
    small = sorted((m for m in moves if m[2] < below_bytes), key=lambda m: (m[1].chunk, m[1].offset))
    runs: list[Run] = []
    current: Run = []
    for move in small:
        if current and _follows(current, move):
            current.append(move)
            continue
        runs.append(current)
        current = [move]
    runs.append(current)
    packed = [run for run in runs if len(run) > 1]
    in_runs = {id(move[0]) for run in packed for move in run}
    return packed, [move for move in moves if id(move[0]) not in in_runs]


def _follows(run: Run, move: tuple["_StorageGroup", Slot, int]) -> bool:
    _, last, _ = run[-1]
    _, slot, nbytes = move
    adjacent = slot.chunk == last.chunk and slot.offset == last.offset + _align(last.capacity_bytes)
    return adjacent and slot.offset + nbytes - run[0][1].offset <= RUN_MAX_BYTES


def copy_run_to_host(run: Run, arena: HostArena, *, non_blocking: bool) -> None:
    """The run's storages into their slots: gathered into one device buffer, then one device-to-host copy."""
    first, span = run[0][1], _span(run)
    staging = torch.empty(span, dtype=torch.uint8, device=run[0][0].storage.device)
    starts = [slot.offset - first.offset for _, slot, _ in run]
    torch._foreach_copy_(
        [staging[start : start + nbytes] for start, (_, _, nbytes) in zip(starts, run)],
        [storage_as_bytes(group.storage, nbytes) for group, _, nbytes in run],
    )
    # host_bytes of the first slot, widened to the run: the slots after it in the same chunk
    arena.host_bytes(first, span).copy_(staging, non_blocking=non_blocking)


def copy_run_to_device(run: Run, arena: HostArena, *, non_blocking: bool) -> None:
    """The run's slots into their (regrown) storages: one host-to-device copy, then one scatter kernel."""
    first, span = run[0][1], _span(run)
    staging = torch.empty(span, dtype=torch.uint8, device=run[0][0].storage.device)
    staging.copy_(arena.host_bytes(first, span), non_blocking=non_blocking)
    starts = [slot.offset - first.offset for _, slot, _ in run]
    torch._foreach_copy_(
        [storage_as_bytes(group.storage, nbytes) for group, _, nbytes in run],
        [staging[start : start + nbytes] for start, (_, _, nbytes) in zip(starts, run)],
    )
    # staging is freed on return; the caching allocator reuses it only in this stream's order


def _span(run: Run) -> int:
    _, last, nbytes = run[-1]
    return last.offset + nbytes - run[0][1].offset
