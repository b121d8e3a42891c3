"""Offload and reload of tensors per unique storage, keeping tensor identity.

One home for a move: listing the storages, issuing their copies (largest first; small storages in
packed runs of back-to-back arena slots), freeing them as the copies finish, and regrowing them on reload.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from refitkit.errors import InvalidInput, RefitError
from refitkit.offload._views import Records, _check_views, _forget_views, _keep_resident, _view_records, _views_of
from refitkit.offload.arena import HostArena, Slot
from refitkit.offload.device import (
    SegmentedRegrow,
    align_up,
    local_tensor,
    regrowable,
    resolved_device,
    storage_as_bytes,
    synchronize,
)
from refitkit.offload.early import RoundPlan, cancel_early, early_device, issued_as_planned, move_began
from refitkit.offload.stats import EMPTY_MOVE, MoveStats

TensorSet = Mapping[str, torch.Tensor] | Iterable[torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass
class StorageGroup:
    """One unique storage and the named tensors that view it."""

    storage: torch.UntypedStorage
    views: list[tuple[str, torch.Tensor]]

    @property
    def first_name(self) -> str:
        return self.views[0][0]


def named_tensors(tensors: TensorSet, *, prefix: str = "tensors") -> list[tuple[str, torch.Tensor]]:
    """Normalise a dict, a list of tensors or a list of (name, tensor) into named local tensors."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    named: list[tuple[str, torch.Tensor]] = []
    for index, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, tensor = item
        else:
            name, tensor = f"{prefix}[{index}]", item
        if not isinstance(tensor, torch.Tensor):
            raise InvalidInput(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        local = local_tensor(tensor)
        # the caller's own pair when it already is one: a thousand new tuples a move, alive across its collections,
        # would be promoted to the oldest generation and bring the next full collection of the trainer's heap closer
        named.append(item if local is tensor and type(item) is tuple else (name, local))
    return named


def _group_by_storage(named: list[tuple[str, torch.Tensor]]) -> list[StorageGroup]:
    groups: dict[int, StorageGroup] = {}
    for name, tensor in named:
        if tensor.layout != torch.strided:
            raise InvalidInput(f"{name!r} has layout {tensor.layout}; only strided tensors can be offloaded")
        storage = tensor.untyped_storage()
        group = groups.get(storage._cdata)
        if group is None:
            groups[storage._cdata] = StorageGroup(storage, [(name, tensor)])
        else:
            group.views.append((name, tensor))
    return list(groups.values())


def _common_device(groups: list[StorageGroup], what: str) -> torch.device | None:
    device: torch.device | None = None
    first = ""
    for group in groups:
        if device is None:
            device, first = group.storage.device, group.first_name
        elif group.storage.device != device:
            raise InvalidInput(
                f"{what}: mixed devices: {first!r} is on {device} but {group.first_name!r} is on "
                f"{group.storage.device}; pass one device's tensors per call"
            )
    return device


def _offloadable_groups(tensors: TensorSet, what: str) -> tuple[list[StorageGroup], torch.device | None]:
    """The storages an offload moves, with their device, checked before anything is freed or filed."""
    groups = [g for g in _group_by_storage(named_tensors(tensors)) if g.storage.nbytes() > 0]
    device = _common_device(groups, what)
    if device is not None and device.type == "meta":
        raise InvalidInput(f"{groups[0].first_name!r} is on the meta device and has no bytes to move")
    for group in groups:
        if not regrowable(group.storage):
            raise InvalidInput(
                f"{group.first_name!r} lives in a non-resizable storage (shared memory or an external "
                "buffer) and cannot be freed in place"
            )
    return groups, device


def offload_tensors(
    tensors: TensorSet,
    arena: HostArena,
    *,
    non_blocking: bool = True,
    pack_below_bytes: int = 0,
    while_copying: Callable[[], None] | None = None,
    plan: RoundPlan | None = None,
    ahead: TensorSet | None = None,
) -> MoveStats:
    """Copy each unique storage into ``arena`` and free it on the device (``resize_(0)``).

    Tensors keep their identity (same Python objects, same storages, now 0 bytes), so optimizer
    and engine references stay valid. Storages already offloaded to this arena are skipped.
    Everything is validated before anything is freed or filed. ``pack_below_bytes``: storages smaller
    than this whose slots lie back to back move as one copy per run (see ``packed_runs``; 0: off).
    ``while_copying``: called once the copies are issued, before waiting for them (a caller's
    bookkeeping then overlaps the copies instead of following them). ``plan``: the copies issued
    early from the last round's plan (``early.RoundPlan``), which this move then remembers.
    ``ahead``: as for ``reload_tensors`` (copied first here too: a plan remembers this order, and the
    next reload issues its early copies in it).
    """
    pack_below_bytes = _checked_pack(pack_below_bytes)
    early = plan.take() if plan is not None else {}
    device = early_device(early)
    try:
        groups, device = _offloadable_groups(tensors, "offload_tensors")
        if device is None:
            cancel_early(early, regrown=False)
            return EMPTY_MOVE
        start = move_began(plan, early)
        moves = _slotted_moves(arena, groups, _storage_keys(ahead))
        late = issued_as_planned(early, moves)
        late_ids = {id(move) for move in late}
        copied = _CopiedInOrder(device, [move for move in moves if id(move) not in late_ids])
        _issue_to_host(late, arena, pack_below_bytes, non_blocking=non_blocking, copied=copied)
        if plan is not None:
            plan.remember(moves)  # while the copies run (forgotten again if the move fails)
        records = _while_copying(moves, while_copying, arena)
    except BaseException:
        if plan is not None:
            plan.forget()
        _settle_copies(device, None)  # nothing is freed and no record changes; no copy outlives the call
        raise
    arena.views.update(records)
    storages = len(groups)
    del groups, moves, late, records  # their objects die group by group as free_as_done frees them, while copies run
    moved = copied.free_as_done()
    return MoveStats(bytes=moved, storages=storages, seconds=time.perf_counter() - start)


Move = tuple[StorageGroup, Slot, int]  # a storage, its slot, the bytes to move


def _storage_keys(tensors: TensorSet | None) -> frozenset[int]:
    """The storages of ``tensors`` (a move's ``ahead``), by key."""
    if tensors is None:
        return frozenset()
    return frozenset(t.untyped_storage()._cdata for _, t in named_tensors(tensors, prefix="ahead"))


def _largest_first(moves: list[Move], ahead: frozenset[int] = frozenset()) -> list[Move]:
    """The order copies are issued in: largest first, so the host gets ahead of the copy engine at once
    and the launches of small storages (and a packed run's views) overlap the large copies; the storages
    ``ahead`` (by key) first, largest first among them, so that they regrow together in as few segments as fit."""
    return sorted(moves, key=lambda move: (move[0].storage._cdata not in ahead, -move[2]))  # type: ignore[attr-defined]


def _while_copying(moves: list[Move], extra: Callable[[], None] | None, arena: HostArena) -> Records:
    """The bookkeeping that needs no finished copy, done while the copies run rather than after them; the
    view records to file once the copies are done (a failed move leaves the arena's records as they were)."""
    records: Records = {}
    resident = arena.resident_views
    for group, slot, nbytes in moves:
        slot.nbytes, slot.device = nbytes, group.storage.device
        _view_records(group.storage._cdata, group.views, records, resident)
    if extra is not None:
        extra()
    return records


def _slotted_moves(arena: HostArena, groups: list[StorageGroup], ahead: frozenset[int] = frozenset()) -> list[Move]:
    """Each storage with its slot and bytes, largest first (those ``ahead`` first); one allocation for all storages
    new to the arena.

    A steady round (every storage has a slot that fits) allocates nothing and walks the storages once.
    """
    # settle background reservations first: a slot they register was sized when reserved and may be
    # too small by now, which the check below must see (else the copy runs into the next slot)
    arena._settle_all(arena.reserve_wait_s, "HostArena(reserve_wait_s=...)")
    slots: list[Slot | None] = []
    for group in groups:
        slot = arena.slot_of(group.storage)
        if slot is not None and slot.capacity_bytes < group.storage.nbytes():
            arena.forget(group.storage)  # the storage grew since its slot was made
            slot = None
        slots.append(slot)
    if None in slots:
        arena.reserve(g.storage for g in groups)
        slots = [arena.slot_of(group.storage) for group in groups]
    return _largest_first(
        [(group, slot, group.storage.nbytes()) for group, slot in zip(groups, slots)], ahead
    )  # all slotted now


def reload_tensors(
    tensors: TensorSet,
    arena: HostArena,
    *,
    device: torch.device | str | None = None,
    non_blocking: bool = True,
    pack_below_bytes: int = 0,
    while_copying: Callable[[], None] | None = None,
    plan: RoundPlan | None = None,
    ahead: TensorSet | None = None,
) -> MoveStats:
    """Restore each unique storage from ``arena`` (``resize_`` then copy), in place.

    ``device``, when given, must be the device the storages were offloaded from: storages keep
    their identity and so their device. Storages already resident are skipped.
    ``pack_below_bytes``, ``while_copying`` and ``plan`` as for ``offload_tensors``; storages
    regrown early that this reload does not restore are freed again. ``ahead``: some of ``tensors``
    (a model's weights) whose storages regrow first, together: a weight sync that exports the
    allocations holding them then maps fewer (after a flush each shared segment is one allocation).
    """
    pack_below_bytes = _checked_pack(pack_below_bytes)
    early = plan.take() if plan is not None else {}
    try:
        named = named_tensors(tensors)
        leading = _storage_keys(ahead)
        if not named and not isinstance(tensors, (list, tuple, Mapping)) and arena.held_bytes:
            raise InvalidInput(
                f"reload_tensors got no tensors from a {type(tensors).__name__} while the arena still holds "
                f"{arena.held_bytes} offloaded bytes: was it already consumed (a generator such as model.parameters() "
                "can be iterated once)? Nothing was reloaded; pass the tensors again (a list)"
            )
        pending = reload_plan(named, arena, device=device, regrown_early=early)
        device = _common_device([g for g, _ in pending], "reload_tensors")
        restoring = {group.storage._cdata for group, _ in pending}
        cancel_early({key: copy for key, copy in early.items() if key not in restoring}, regrown=True)
    except BaseException:
        if plan is not None:
            plan.forget()
        cancel_early(early, regrown=True)
        raise
    if not pending:
        return EMPTY_MOVE
    start = move_began(plan, early)
    restoring_group: StorageGroup | None = None
    popped: Records = {}
    moves = _largest_first([(group, slot, slot.nbytes) for group, slot in pending], ahead=leading)
    late = issued_as_planned(early, moves)
    runs, singles = packed_runs(late, below_bytes=pack_below_bytes) if pack_below_bytes else ([], late)
    try:
        segments = SegmentedRegrow(device, [nbytes for _, _, nbytes in singles])
        for index, (group, slot, nbytes) in enumerate(singles):
            restoring_group = group
            segments.before(index)
            group.storage.resize_(nbytes)
            storage_as_bytes(group.storage).copy_(arena.host_bytes(slot, nbytes), non_blocking=non_blocking)
        for run in runs:  # after the large copies, so building a run's views overlaps them
            restoring_group = run[0][0]
            for group, _slot, nbytes in run:
                group.storage.resize_(nbytes)
            copy_run_to_device(run, arena, non_blocking=non_blocking)
        restoring_group = None
        if plan is not None:
            plan.remember(moves)  # while the copies run (forgotten again if the move fails)
        if while_copying is not None:
            while_copying()
        # the bookkeeping while the copies run; undone below if they fail
        finished = finish_reload(pending, arena, seconds=0.0, restored_views=_views_of(arena, restoring), popped=popped)
        del early, moves, late, runs, singles  # released while the copies run (a failure needs only pending)
        synchronize(device)
    except BaseException as error:
        if plan is not None:
            plan.forget()
        _unfinish(pending, arena, popped)
        _roll_back(pending, device)
        if not isinstance(error, Exception):
            raise
        what = f"restoring {restoring_group.first_name!r}" if restoring_group is not None else "waiting for the copies"
        raise RefitError(
            f"reload_tensors failed while {what} on {device} ({type(error).__name__}: {error}); every storage of "
            "this call was freed again and its bytes are still in the arena: free device memory (e.g. the "
            "inference engine's KV cache) and call reload again"
        ) from error
    return replace(finished, seconds=time.perf_counter() - start)


def reload_plan(
    named: list[tuple[str, torch.Tensor]],
    arena: HostArena,
    *,
    device: torch.device | str | None = None,
    regrown_early: Mapping[int, object] | None = None,
) -> list[tuple[StorageGroup, Slot]]:
    """The storages a reload must restore, each with its slot; validated before a byte moves (except the
    early copies of ``regrown_early``, by storage key, whose storages count as not regrown yet)."""
    _check_views(arena, named)
    groups = _group_by_storage(named)
    expected = torch.device(device) if device is not None else None
    pending: list[tuple[StorageGroup, Slot]] = []
    for group in groups:
        slot = arena.slot_of(group.storage)
        if slot is None or not slot.holds_data:
            if group.storage.nbytes() == 0 and any(t.numel() > 0 for _, t in group.views):
                raise InvalidInput(
                    f"{group.first_name!r} has no device bytes and this arena holds none for its storage: "
                    "it was replaced (e.g. `.data = ...`) or offloaded into another arena"
                )
            continue  # resident (or 0-size): nothing to restore
        if group.storage.nbytes() != 0 and (regrown_early is None or group.storage._cdata not in regrown_early):
            raise InvalidInput(
                f"{group.first_name!r}: its storage was resized to {group.storage.nbytes()} bytes after offload "
                f"(it held {slot.nbytes}); reload would overwrite those bytes, so nothing was restored"
            )
        if expected is not None and resolved_device(expected) != resolved_device(slot.device):
            raise InvalidInput(
                f"{group.first_name!r} was offloaded from {slot.device}, cannot reload to {expected}: "
                "storages keep their device"
            )
        pending.append((group, slot))
    return pending


def finish_reload(
    pending: list[tuple[StorageGroup, Slot]],
    arena: HostArena,
    *,
    seconds: float,
    restored_views: list[int] | None = None,
    popped: Records | None = None,
) -> MoveStats:
    """Release the slots of restored storages (their host bytes may now be overwritten).

    ``restored_views``: their view records' keys, when already looked up (``_views_of``).
    ``popped``: collects the view records taken out, so ``_unfinish`` can put them back.
    """
    moved = 0
    for _, slot in pending:
        slot.holds_data = False
        moved += slot.nbytes
    if restored_views is None:
        restored_views = _views_of(arena, {group.storage._cdata for group, _ in pending})
    _keep_resident(arena, restored_views, popped)
    return MoveStats(bytes=moved, storages=len(pending), seconds=seconds)


def _unfinish(pending: list[tuple[StorageGroup, Slot]], arena: HostArena, popped: Records) -> None:
    """Undo ``finish_reload`` for a reload whose copies then failed: the slots hold the bytes again."""
    for _, slot in pending:
        slot.holds_data = True
    arena.views.update(popped)


def _roll_back(pending: list[tuple[StorageGroup, Slot]], device: torch.device) -> None:
    """Free what a failed reload regrew, so the same call can be retried (the slots still hold the bytes)."""
    _settle_copies(device, None)  # queued copies may still write into the storages about to be freed
    for group, _ in pending:
        if group.storage.nbytes() != 0:
            group.storage.resize_(0)


def drop_tensors(tensors: TensorSet, arena: HostArena) -> int:
    """Free device storages WITHOUT copying them (e.g. grads about to be recomputed); returns bytes freed.

    The arena remembers each storage's size (no host bytes) so ``regrow_tensors`` can restore
    it. Storages whose bytes the arena holds from an offload keep that copy.
    """
    groups = [g for g in _group_by_storage(named_tensors(tensors)) if g.storage.nbytes() > 0]
    device = _common_device(groups, "drop_tensors")
    freed = 0
    for group in groups:
        arena.remember_dropped(group.storage)
        freed += group.storage.nbytes()
    if device is not None:
        synchronize(device)  # a reduction may still be reading these bytes
    for group in groups:
        group.storage.resize_(0)
    return freed


def regrow_tensors(tensors: TensorSet, arena: HostArena, *, zero: bool = True) -> int:
    """Give dropped (or offloaded) storages their device bytes back WITHOUT copying; returns bytes.

    For state that is about to be zeroed or recomputed: with ``zero`` the bytes are zeroed,
    otherwise they are uninitialised. An offloaded storage regrown this way gives up its host copy.
    """
    restored: set[int] = set()
    nbytes = 0
    for group in _group_by_storage(named_tensors(tensors)):
        if group.storage.nbytes() != 0:
            continue
        size = arena.dropped_size(group.storage)
        if size is None:
            slot = arena.slot_of(group.storage)
            if slot is None or not slot.holds_data:
                continue
            slot.holds_data = False
            size = slot.nbytes
        group.storage.resize_(size)
        if zero:
            storage_as_bytes(group.storage).zero_()
        restored.add(group.storage._cdata)
        nbytes += size
    _forget_views(arena, restored)
    return nbytes


def _checked_pack(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput(f"pack_below_bytes={value!r}; need an int >= 0 (0: every storage is copied on its own)")
    return value


# -- Issuing a move's copies and waiting for them: host copies issued in order, storages freed as they finish ---


def _issue_to_host(
    moves: list[Move],
    arena: HostArena,
    pack_below_bytes: int,
    *,
    non_blocking: bool,
    copied: _CopiedInOrder | None = None,
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


def _settle_copies(device: torch.device | None, stream: torch.cuda.Stream | None) -> None:
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


# -- Packed copies of small storages: one host<->device copy per run of back-to-back arena slots ---
# A copy of a few KiB costs about as much as its launch, so thousands of small storages (norm
# weights, biases and their optimizer state) stay far below the flat copy rate. Slots reserved
# together lie back to back in one host chunk; for such a run the device side is staged in one
# buffer (one multi-tensor copy kernel) and the host side moves in one copy. The bytes that land in
# each slot are exactly those of the per-storage copy; the alignment padding between slots belongs
# to no slot.


RUN_MAX_BYTES = 64 << 20  # bounds the device staging buffer of one run

Run = list[tuple["StorageGroup", Slot, int]]  # (group, slot, bytes to move)


def packed_runs(moves: Sequence[tuple[StorageGroup, Slot, int]], *, below_bytes: int) -> tuple[list[Run], list]:
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


def _follows(run: Run, move: tuple[StorageGroup, Slot, int]) -> bool:
    _, last, _ = run[-1]
    _, slot, nbytes = move
    adjacent = slot.chunk == last.chunk and slot.offset == last.offset + align_up(last.capacity_bytes)
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
