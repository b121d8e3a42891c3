"""Issuing a move's copies and waiting for them: host copies issued in order, storages freed as they finish."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from refitkit.offload._packed import copy_run_to_host, packed_runs
from refitkit.offload.arena import HostArena
from refitkit.offload.device import storage_as_bytes, synchronize

if TYPE_CHECKING:
    from refitkit.offload.moves import Move


def _issue_to_host(
    moves: list[Move], arena: HostArena, pack_below_bytes: int, *, non_blocking: bool, copied: _CopiedInOrder | None = None
) -> None:
    runs, singles = packed_runs(moves, below_bytes=pack_below_bytes) if pack_below_bytes else ([], moves)
    for move in singles:
        group, slot, nbytes = move
        arena.host_bytes(slot, nbytes).copy_(storage_as_bytes(group.storage, nbytes), non_blocking=non_blocking)
        if copied is not None:
            copied.issued(move)
    for run in runs:  # after the large copies, so building a run's views overlaps them
        copy_run_to_host(run, arena, non_blocking=non_blocking)
        if copied is not None:
            copied.issued(*run)


FREE_EVERY_COPIES = 64  # an offload frees its storages in groups this large, each once its copies are done


class _CopiedInOrder:
    """An offload's copies in the order they were issued, with a CUDA event after every ``FREE_EVERY_COPIES``,
    so the storages are freed group by group while the later copies still run (the ``resize_(0)`` of a thousand
    storages would otherwise follow the last copy)."""

    def __init__(self, device: torch.device, issued_before: list[Move]) -> None:
        self._device, self._cuda = device, device.type == "cuda"
        self._groups: list[tuple[list[Move], torch.cuda.Event | None]] = []
        self._open: list[Move] = []
        if issued_before:  # (copies already queued, e.g. early ones): done once everything queued so far is
            self._open = list(issued_before)
            self._close()

    def issued(self, *moves: Move) -> None:
        self._open.extend(moves)
        if len(self._open) >= FREE_EVERY_COPIES:
            self._close()

    def _close(self) -> None:
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
        self._groups.append((self._open, event))
        self._open = []

    def free_as_done(self) -> int:
        """Free each group once its copies are done, the last after the phase's synchronize; the bytes moved.

        Interrupted part-way (or a failed wait), it still finishes the move before raising, so no storage is
        left at 0 bytes without its slot holding the bytes: every copy was issued; they are waited for."""
        moved, freed = 0, 0
        groups = self._groups
        try:
            for moves, event in groups:
                if event is not None:
                    event.synchronize()
                moved += _free_offloaded(moves)
                groups[freed] = ([], None)  # its moves are released now, while the later copies still run
                freed += 1
            synchronize(self._device)
        except BaseException:
            _settle_copies(self._device, None)
            for moves, _ in self._groups[freed:]:
                _free_offloaded(moves)
            _free_offloaded(self._open)
            raise
        return moved + _free_offloaded(self._open)


def _settle_copies(device: torch.device | None, stream: "torch.cuda.Stream | None") -> None:
    """After a failure part-way through issuing: wait for the copies already queued (best effort: the
    failure being raised is the one to report), so none writes into host memory after the call."""
    try:
        if stream is not None:
            stream.synchronize()
        elif device is not None:
            synchronize(device)
    except Exception:  # noqa: BLE001 - a second error while unwinding the first
        pass


def _free_offloaded(moves: list[Move]) -> int:
    """After the copies completed: each slot holds its storage's bytes and the storage is freed; the bytes."""
    moved = 0
    for group, slot, nbytes in moves:
        moved += nbytes
        slot.holds_data = True
        group.storage.resize_(0)
    return moved
