"""An offload split in two, for overlapping it with other work: copies issued on a side stream now
(``start_offload``), storages freed once they are done (``finish_offload``) or kept (``cancel_offload``).

On CUDA the copies are issued by a worker thread. A stream's launch queue holds about a thousand
entries and a large host copy takes many of them, so issuing an optimizer's state (32.7 GB for
Qwen3-8B + AdamW) blocks the issuing thread until the copy engine is within a few milliseconds of
the end: measured on an H200, ``start_offload`` returned after ~0.58 s of the 0.59 s of copies, and the
weight sync it was meant to overlap ran after them. The worker waits for queue room instead (torch
releases the GIL while a copy is issued), then files the view records; ``finish_offload`` and
``cancel_offload`` join it, bounded.

Planning the copies (listing, grouping and checking 1197 storages of Qwen3-8B's fused AdamW state,
finding their slots) is Python that took 8 ms on an H200 host before the first copy, and the records
another 9 while the worker waited for the GIL. With the last round's plan (``early.RoundPlan``) its
largest copies are issued first, on the side stream, and the copy engine runs while the round is planned.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from refitkit.errors import InvalidInput, RefitError
from refitkit.offload._views import Records
from refitkit.offload.arena import HostArena
from refitkit.offload.early import RoundPlan, issued_as_planned
from refitkit.offload.moves import (
    Move,
    TensorSet,
    _free_offloaded,
    _issue_to_host,
    _offloadable_groups,
    _settle_copies,
    _slotted_moves,
    _while_copying,
)
from refitkit.offload.stats import MoveStats


@dataclass
class OffloadCopies:
    """Copies issued by ``start_offload`` and not waited for yet: the device storages still hold their bytes."""

    arena: HostArena
    moves: list[Move]
    records: Records  # filed by finish_offload, once the copies are done (on CUDA the worker makes them)
    device: torch.device | None
    stream: torch.cuda.Stream | None  # the side stream the copies run on (None on the CPU)
    started: float
    open: bool = True
    issuer: _Issuer | None = field(default=None)  # the worker issuing the copies (CUDA), joined before any wait
    early_copies: int = 0  # of the moves, those issued from the last round's plan before this round was planned
    # storages copied early that this round does not move: kept alive (and their slots taken) until the stream is waited for
    stale_early: list[torch.UntypedStorage] = field(default_factory=list)


ISSUE_TIMEOUT_S = 300.0  # how long finish/cancel wait for the worker to issue the copies (they wait for queue room)
EARLY_FLIGHT_COPIES = (
    8  # the last round's largest copies issued before the round is planned (Qwen3-8B AdamW: 5.4 GB, ~97 ms)
)


class _Issuer(threading.Thread):
    """Issues an offload's copies on its side stream, so the caller goes on while the launch queue is full;
    then makes the move's view records (``records``), which need no finished copy."""

    def __init__(self, moves: list[Move], issue: list[Move], arena: HostArena, stream: torch.cuda.Stream) -> None:
        super().__init__(name="refitkit-offload-issue", daemon=True)
        self._moves, self._issue, self._arena, self._stream = moves, issue, arena, stream
        self.records: Records = {}
        # what issuing raised, as text: the exception's traceback would hold the moves (and through them the
        # storages and the arena) in a reference cycle only a garbage collection frees
        self.error: str | None = None
        _live_issuers.add(self)

    def run(self) -> None:
        try:
            torch.cuda.set_device(self._stream.device)  # (each thread has its own current device)
            with torch.cuda.stream(self._stream):
                _issue_to_host(self._issue, self._arena, 0, non_blocking=True)
            self.records = _while_copying(self._moves, None, self._arena)
        except BaseException as error:  # noqa: BLE001 - raised by finish_offload in the caller's thread
            self.error = f"{type(error).__name__}: {error}"
        finally:
            self._moves, self._issue = [], []


_live_issuers: weakref.WeakSet[_Issuer] = weakref.WeakSet()


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


def issue_early(
    plan: RoundPlan | None, arena: HostArena, *, stream: torch.cuda.Stream | None = None
) -> torch.cuda.Stream | None:
    """The last round's largest copies (``EARLY_FLIGHT_COPIES``) of ``plan`` issued now, on a side stream that first
    waits for the work queued so far (the step that wrote the state); the stream (give it to ``start_offload``
    with the plan), or None where nothing was issued. Each copy is checked against the arena as a ``RoundPlan``
    checks it; a copy of a storage the round no longer moves only wrote a slot that holds nothing."""
    device = plan.device if plan is not None else None
    if plan is None or device is None or device.type != "cuda":
        return None
    side = stream if stream is not None else torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        plan.issue_offload(arena, limit=EARLY_FLIGHT_COPIES)
    return side


def start_offload(
    tensors: TensorSet, arena: HostArena, *, stream: torch.cuda.Stream | None = None, plan: RoundPlan | None = None
) -> OffloadCopies:
    """Issue each unique storage's copy into ``arena`` on a side stream and return at once; frees nothing.

    The side stream first waits for the work already queued on the current stream (e.g. the
    optimizer step that wrote the state). On CUDA a worker thread issues the copies (largest
    first), so the caller is not held while the launch queue is full. ``finish_offload`` waits for
    them (one synchronize) and frees the storages; ``cancel_offload`` waits and leaves them on the
    device. Nothing may write or free these tensors in between (their copies would be stale).
    ``plan``: the last round's moves of these tensors; the copies ``issue_early`` issued from it (on
    ``stream``) are not issued again, and it remembers this round's. A check that fails waits for them.
    """
    started = time.perf_counter()
    try:
        groups, device = _offloadable_groups(tensors, "start_offload")
        moves = (
            _slotted_moves(arena, groups) if device is not None else []
        )  # waits for a background reservation (bounded)
    except BaseException:
        if plan is not None:
            plan.forget()
            plan.cancel()  # the early copies are waited for: none writes after the error
        raise
    early = plan.take() if plan is not None else {}
    try:
        late = issued_as_planned(early, moves)
        if plan is not None:
            started = plan.began if early else started  # the early copies' bytes count, so does their time
            plan.remember(moves)
        if device is None or device.type != "cuda":
            if early and stream is not None:
                stream.synchronize()  # early copies of storages this round no longer moves: none outlives the call
            _issue_to_host(late, arena, 0, non_blocking=True)  # (CPU copies are done when issued)
            return OffloadCopies(arena, moves, _while_copying(moves, None, arena), device, None, started)
        side = stream if stream is not None and stream.device == device else None
        if stream is not None and side is None:
            stream.synchronize()  # early copies on another device than this round's tensors: done before going on
        side = side if side is not None else torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        moved = {group.storage._cdata for group, _, _ in moves}
        stale = [storage for key, (storage, _, _) in early.items() if key not in moved]
        issuer = _Issuer(moves, late, arena, side)
        issuer.start()
    except BaseException:
        early_device = plan.device if plan is not None else None  # (the early copies', before the plan forgets it)
        if plan is not None:
            plan.forget()
        _settle_copies(device if device is not None else early_device, None)  # no copy outlives the error
        raise
    return OffloadCopies(
        arena, moves, {}, device, side, started, issuer=issuer, early_copies=len(moves) - len(late), stale_early=stale
    )


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
    copies.stale_early = []
    if copies.issuer is not None:
        copies.records, copies.issuer.records = copies.issuer.records, {}
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
    copies.stale_early = []
