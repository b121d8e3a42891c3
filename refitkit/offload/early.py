"""Early copies: a steady round's copies issued from the last round's plan, before this round is planned.

A steady round moves the same storages through the same slots as the round before. Planning it
(listing the engine's tensors, grouping them by storage, checking each one and finding its slot)
is Python per tensor that runs before the first copy, and the copy engine waits for it: with a
thousand storages (Qwen3-0.6B + AdamW has 1240) that is several percent of the move. So an
adapter keeps, per set of parts, the moves of their last offload or reload (a ``RoundPlan``, which
keeps nothing alive) and issues those copies first, each one checked against the arena (the same
storage in the same slot, with the same bytes, on the right side of the move). It then lists,
checks and plans the round as before while they run, and ``offload_tensors`` / ``reload_tensors``
reconcile: a planned move that was not issued early is issued then; a storage regrown early that
the plan does not restore is freed again.

Nothing is freed, filed or marked until the whole round is planned and checked, so a check that
fails leaves everything as it was, as without early copies: an early offload copy only wrote the
host bytes of a slot that held nothing, and an early reload is undone (the arena still holds the
bytes). Either way the copies are waited for before the error is raised, so none outlives the call.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from refitkit.offload.arena import HostArena, Slot
from refitkit.offload.device import SegmentedRegrow, regrowable, storage_as_bytes, synchronize

# At most this many early copies (the largest): once the device's launch queue is full, each launch waits for
# a queued copy to finish, and the host would sit in the early issue instead of planning the round meanwhile.
EARLY_COPIES_MAX = 256
Issued = dict[int, tuple[torch.UntypedStorage, Slot, int]]  # storage key -> (storage, slot, bytes) copied early


def _storage_of(slot: Slot) -> torch.UntypedStorage | None:
    """The storage ``slot`` serves, if it is alive: a strong reference made from the slot's weak one.

    ``UntypedStorage._new_with_weak_ptr`` is private torch API (checked on torch 2.11 and 2.13; torch's own
    ``torch.multiprocessing.reductions`` uses it the same way); it returns None once the storage died.
    """
    ref = slot.storage_ref
    return None if ref is None else torch.UntypedStorage._new_with_weak_ptr(ref.cdata)


class RoundPlan:
    """The moves of one set of parts' last offload or reload, largest first; issued early by the next move."""

    def __init__(self) -> None:
        # the remembered moves as three parallel lists (storage key, slot, bytes): no tuple per storage, which
        # would live a whole round and be promoted to the oldest generation of the collector every round. The
        # storage itself is found again through the slot's weak reference: a tensor would not do, since a
        # DTensor's local view is a new object every time.
        self._keys: list[int] = []
        self._slots: list[Slot] = []
        self._sizes: list[int] = []
        self._issued: Issued = {}
        self._regrown = False  # whether the early copies were a reload's (storages regrown)
        self.began = 0.0  # when the early copies began (perf_counter): a move's time counts from here
        self.device: torch.device | None = None  # the remembered storages' device (None when there are none)

    def remember(self, moves: list[tuple[object, Slot, int]]) -> None:
        """Keep a finished move's storages (``(group, slot, bytes)``, in the order they were issued)."""
        self._keys = [group.storage._cdata for group, _, _ in moves]  # type: ignore[attr-defined]
        self._slots = [slot for _, slot, _ in moves]
        self._sizes = [nbytes for _, _, nbytes in moves]
        self.device = moves[0][0].storage.device if moves else None  # type: ignore[attr-defined]

    def forget(self) -> None:
        """Issue nothing early next time (a move failed, or moved something else)."""
        self._keys, self._slots, self._sizes = [], [], []
        self.device = None

    def _still_planned(self, arena: HostArena) -> Iterator[tuple[int, torch.UntypedStorage, Slot, int]]:
        """(index in the plan, storage, slot, bytes) of each remembered storage still alive and in its slot."""
        for index, (key, slot, nbytes) in enumerate(zip(self._keys, self._slots, self._sizes)):
            storage = _storage_of(slot)
            if storage is not None and storage._cdata == key and arena.slot_of(storage) is slot:
                yield index, storage, slot, nbytes

    def _begin(self, *, regrown: bool) -> None:
        self.cancel()  # early copies a move never took (a caller's failure between issue and move)
        self._regrown = regrown
        self.began = time.perf_counter()

    def issue_offload(self, arena: HostArena, *, limit: int = EARLY_COPIES_MAX) -> None:
        """Copy each remembered storage still on the device, with the bytes it had, into its empty slot
        (the ``limit`` largest, on the current stream)."""
        self._begin(regrown=False)
        try:
            for _, storage, slot, nbytes in self._still_planned(arena):
                if slot.holds_data or storage.nbytes() != nbytes or nbytes > slot.capacity_bytes:
                    continue
                arena.host_bytes(slot, nbytes).copy_(storage_as_bytes(storage, nbytes), non_blocking=True)
                self._issued[storage._cdata] = (storage, slot, nbytes)
                if len(self._issued) >= limit:
                    break
        except Exception:  # a shortcut only: the planned move issues (and reports) whatever failed here
            self._give_up()

    def issue_reload(self, arena: HostArena) -> None:
        """Regrow each remembered storage that is still offloaded into its slot, and copy its bytes back."""
        self._begin(regrown=True)
        if not self._slots:
            return
        # shared segments sized from the remembered moves (an entry that no longer qualifies only leaves room)
        segments = SegmentedRegrow(self._slots[0].device, self._sizes[:EARLY_COPIES_MAX])
        try:
            for index, storage, slot, nbytes in self._still_planned(arena):
                if not slot.holds_data or slot.nbytes != nbytes or storage.nbytes() != 0 or not regrowable(storage):
                    continue  # (the planned reload refuses what cannot be regrown, naming it)
                segments.before(index)
                self._issued[storage._cdata] = (storage, slot, nbytes)
                storage.resize_(nbytes)
                storage_as_bytes(storage).copy_(arena.host_bytes(slot, nbytes), non_blocking=True)
                if len(self._issued) >= EARLY_COPIES_MAX:
                    break
        except Exception:  # e.g. out of device memory: the planned reload regrows (and reports) the rest
            self._give_up()

    def _give_up(self) -> None:
        self.forget()
        self.cancel()

    def take(self) -> Issued:
        """The copies issued early, now the caller's to reconcile (and to undo on failure)."""
        issued, self._issued = self._issued, {}
        return issued

    def cancel(self) -> None:
        """The move failed before it took the early copies: wait for them; free what a reload regrew."""
        cancel_early(self.take(), regrown=self._regrown)


def move_began(plan: RoundPlan | None, issued: Issued) -> float:
    """When a move began: at its first early copy if it took any (their bytes count, so must their time), else now."""
    return plan.began if issued and plan is not None else time.perf_counter()


def early_device(issued: Issued) -> torch.device | None:
    """The device of the early copies (None when there are none)."""
    return next(iter(issued.values()))[0].device if issued else None


def cancel_early(issued: Issued, *, regrown: bool) -> None:
    """Wait for early copies no move will use, and free the storages a reload regrew for them."""
    if not issued:
        return
    storages = [storage for storage, _, _ in issued.values()]
    try:
        synchronize(storages[0].device)  # none may write into host or device memory after the call
    finally:
        if regrown:
            for storage in storages:
                if storage.nbytes() != 0:
                    storage.resize_(0)


def issued_as_planned(issued: Issued, moves: list[tuple[object, Slot, int]]) -> list[tuple[object, Slot, int]]:
    """The moves that still need their copy: those not issued early exactly so (same slot, same bytes)."""
    if not issued:
        return moves
    late = []
    for move in moves:
        group, slot, nbytes = move
        early = issued.get(group.storage._cdata)  # type: ignore[attr-defined]
        if early is None or early[1] is not slot or early[2] != nbytes:
            late.append(move)
    return late
