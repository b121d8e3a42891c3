"""An offload split in two, for overlapping it with other work: copies issued on a side stream now
(``start_offload``), storages freed once they are done (``finish_offload``) or kept (``cancel_offload``).

On CUDA the copies are issued by a worker thread. A stream's launch queue holds about a thousand
entries and a large host copy takes many of them, so issuing an optimizer's state (32.7 GB for
Qwen3-8B + AdamW) blocks the issuing thread until the copy engine is within a few milliseconds of
the end: measured on an H200, ``start_offload`` returned after ~0.58 s of the 0.59 s of copies, and the
weight sync it was meant to overlap ran after them. The worker waits for queue room instead (torch
releases the GIL while a copy is issued); ``finish_offload`` and ``cancel_offload`` join it, bounded.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from refitkit.errors import InvalidInput, RefitError
from refitkit.offload.arena import HostArena
from refitkit.offload.moves import _free_offloaded, _issue_to_host
from refitkit.offload._views import Records
from refitkit.offload.moves import Move, TensorSet, _offloadable_groups, _slotted_moves, _while_copying
from refitkit.offload.stats import MoveStats


@dataclass
class OffloadCopies:
    """Copies issued by ``start_offload`` and not waited for yet: the device storages still hold their bytes."""

    arena: HostArena
    moves: list[Move]
    records: Records  # filed by finish_offload, once the copies are done
    device: torch.device | None
    stream: "torch.cuda.Stream | None"  # the side stream the copies run on (None on the CPU)
    started: float
    open: bool = True
    issuer: "_Issuer | None" = field(default=None)  # the worker issuing the copies (CUDA), joined before any wait


ISSUE_TIMEOUT_S = 300.0  # how long finish/cancel wait for the worker to issue the copies (they wait for queue room)


class _Issuer(threading.Thread):
    """Issues an offload's copies on its side stream, so the caller goes on while the launch queue is full."""

    def __init__(self, moves: list[Move], arena: HostArena, stream: "torch.cuda.Stream") -> None:
        super().__init__(name="refitkit-offload-issue", daemon=True)
        self._moves, self._arena, self._stream = moves, arena, stream
        # what issuing raised, as text: the exception's traceback would hold the moves (and through them the
        # storages and the arena) in a reference cycle only a garbage collection frees
        self.error: str | None = None
        _live_issuers.add(self)

    def run(self) -> None:
        try:
            torch.cuda.set_device(self._stream.device)  # (each thread has its own current device)
            with torch.cuda.stream(self._stream):
                _issue_to_host(self._moves, self._arena, 0, non_blocking=True)
        except BaseException as error:  # noqa: BLE001 - raised by finish_offload in the caller's thread
            self.error = f"{type(error).__name__}: {error}"
        finally:
            self._moves = []


_live_issuers: "weakref.WeakSet[_Issuer]" = weakref.WeakSet()


@atexit.register
def _join_issuers_at_exit() -> None:
    """A process that exits with copies still being issued (no finish or cancel) lets them be issued first:
    the interpreter would otherwise stop the thread inside a CUDA call, and the C++ runtime aborts the process."""
    deadline = time.monotonic() + ISSUE_TIMEOUT_S
    for issuer in list(_live_issuers):
        issuer.join(max(0.0, deadline - time.monotonic()))


def _join_issuer(copies: OffloadCopies, caller: str) -> str | None:
    """Wait (bounded) until the worker issued every copy, so the stream can be waited for; what it raised."""
    if copies.issuer is None:
        return None
    copies.issuer.join(ISSUE_TIMEOUT_S)
    if copies.issuer.is_alive():
        raise RefitError(
            f"{caller}: the overlapped offload's copies were not all issued within {ISSUE_TIMEOUT_S:g} s (the copy "
            "engine stalled?); nothing was freed; raise refitkit.offload.overlapped.ISSUE_TIMEOUT_S to wait longer"
        )
    return copies.issuer.error


def start_offload(tensors: TensorSet, arena: HostArena, *, stream: "torch.cuda.Stream | None" = None) -> OffloadCopies:
    """Issue each unique storage's copy into ``arena`` on a side stream and return at once; frees nothing.

    The side stream first waits for the work already queued on the current stream (e.g. the
    optimizer step that wrote the state). On CUDA a worker thread issues the copies (largest
    first), so the caller is not held while the launch queue is full. ``finish_offload`` waits for
    them (one synchronize) and frees the storages; ``cancel_offload`` waits and leaves them on the
    device. Nothing may write or free these tensors in between (their copies would be stale).
    """
    groups, device = _offloadable_groups(tensors, "start_offload")
    started = time.perf_counter()
    if device is None:
        return OffloadCopies(arena, [], {}, None, None, started)
    moves = _slotted_moves(arena, groups)  # waits for a background reservation first (bounded)
    records = _while_copying(moves, None, arena)
    if device.type != "cuda":
        _issue_to_host(moves, arena, 0, non_blocking=True)  # (CPU copies are done when issued)
        return OffloadCopies(arena, moves, records, device, None, started)
    side = stream if stream is not None else torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    issuer = _Issuer(moves, arena, side)
    issuer.start()
    return OffloadCopies(arena, moves, records, device, side, started, issuer=issuer)


def finish_offload(copies: OffloadCopies) -> MoveStats:
    """Wait for ``start_offload``'s copies, then free the storages: they are offloaded from here on."""
    if not copies.open:
        raise InvalidInput("finish_offload: these copies were already finished or cancelled")
    error = _join_issuer(copies, "finish_offload")
    if copies.stream is not None:
        copies.stream.synchronize()  # a failure here leaves every storage on the device, untouched
    copies.open = False
    if error is not None:
        raise RefitError(f"finish_offload: issuing the overlapped offload's copies failed ({error}); nothing was freed")
    copies.arena.views.update(copies.records)
    moved = _free_offloaded(copies.moves)
    return MoveStats(bytes=moved, storages=len(copies.moves), seconds=time.perf_counter() - copies.started)


def cancel_offload(copies: OffloadCopies) -> None:
    """Wait for ``start_offload``'s copies and keep every storage on the device (the arena holds nothing of them)."""
    if not copies.open:
        return
    _join_issuer(copies, "cancel_offload")  # what issuing raised is not this caller's error: it cancels anyway
    copies.open = False
    if copies.stream is not None:
        copies.stream.synchronize()  # the host bytes must not be written after this returns
