"""HostArena: exact-size host memory for offloaded storages, allocated once and reused (also in the background:
``Reservation``)."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from refitkit._knobs import checked_seconds
from refitkit.errors import InvalidInput, RefitError, ReserveTimeout
from refitkit.offload.device import align_up

logger = logging.getLogger(__name__)

RESERVE_WAIT_S = 600.0  # default bound of an offload's wait for a background reservation (pinning ~0.3 s/GiB)


@dataclass(frozen=True)
class ViewRecord:
    """What an offloaded tensor looked like, to catch it being replaced or re-viewed before reload."""

    tensor_ref: weakref.ref
    name: str
    storage_key: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: torch.dtype


@dataclass
class Slot:
    """The host bytes that serve one device storage, round after round."""

    chunk: int
    offset: int
    capacity_bytes: int
    storage_ref: StorageWeakRef | None  # None once forgotten: free for another storage
    nbytes: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    holds_data: bool = False

    def expired(self) -> bool:
        return self.storage_ref is None or self.storage_ref.expired()


def _allocate_chunk(nbytes: int, pinned: bool) -> torch.Tensor:
    """Exactly ``nbytes`` of host memory, page-locked with cudaHostRegister when ``pinned``.

    ``pin_memory=True`` would go through torch's caching host allocator, which rounds every
    block up to a power of two (up to ~1.8x the bytes); registering a plain allocation does not.
    """
    chunk = torch.empty(nbytes, dtype=torch.uint8)
    if pinned and nbytes > 0:
        # fault the pages in with all threads first: registering then only locks them (measured on
        # an H200 host: 0.31 s/GiB this way against 0.59 s/GiB registering untouched pages)
        chunk.zero_()
        status = torch.cuda.cudart().cudaHostRegister(chunk.data_ptr(), nbytes, 0)
        if int(status) != 0:
            _clear_cuda_last_error()
            raise RefitError(
                f"cudaHostRegister of {nbytes} host bytes failed with CUDA error {int(status)}; "
                "check the locked-memory limit (ulimit -l) or pass HostArena(pin_memory=False)"
            )
    return chunk


def _layout(sizes: Iterable[int]) -> tuple[list[int], int]:
    """Aligned offsets of storages laid out one after another in one chunk, and the chunk's size."""
    offsets: list[int] = []
    total = 0
    for nbytes in sizes:
        offsets.append(total)
        total += align_up(nbytes)
    return offsets, total


SMALL_SLOT_BYTES = 1 << 20  # storages below this are laid out together, after the larger ones


def _small_last(storages: list[torch.UntypedStorage]) -> list[torch.UntypedStorage]:
    """The larger storages first, then the small ones: a reservation's small slots lie back to back, so a
    packed move (``pack_below_bytes``) takes them in one copy instead of one per slot."""
    return [s for s in storages if s.nbytes() >= SMALL_SLOT_BYTES] + [
        s for s in storages if s.nbytes() < SMALL_SLOT_BYTES
    ]


def _clear_cuda_last_error() -> None:
    """Reset the runtime's per-thread last error after a refused cudaHostRegister.

    Otherwise torch's next kernel-launch check reads it and fails an unrelated op. torch's
    ``cudart()`` bindings have no ``cudaGetLastError``, so it is called in the libcudart this
    process loaded (best effort: with a statically linked runtime there is none to find).
    """
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except OSError as error:
        logger.debug("HostArena: could not reset the CUDA last error: %s", error)


def _release_chunks(chunks: list[torch.Tensor], pinned: bool) -> None:
    if pinned and torch.cuda.is_available():
        for chunk in chunks:
            if chunk.numel() > 0:
                torch.cuda.cudart().cudaHostUnregister(chunk.data_ptr())
    chunks.clear()


class HostArena:
    """Host memory sized exactly for the storages it holds; reused every offload round.

    Each device storage gets a slot the first time it is offloaded (or reserved); later rounds
    copy into the same bytes, so steady rounds allocate and pin nothing. Slots of storages that
    died are reused by new storages that fit.
    """

    def __init__(self, pin_memory: bool | None = None, *, reserve_wait_s: float = RESERVE_WAIT_S) -> None:
        cuda = torch.cuda.is_available()
        if pin_memory and not cuda:
            raise InvalidInput("HostArena(pin_memory=True) needs CUDA; pass pin_memory=None or False on a CPU-only run")
        self.pinned: bool = cuda if pin_memory is None else bool(pin_memory)
        self._chunks: list[torch.Tensor] = []
        self._slots: dict[int, Slot] = {}
        self.views: dict[int, ViewRecord] = {}  # id(tensor) -> record, while offloaded
        # id(tensor) -> its record, since its reload: the next offload takes it again if nothing changed (a record
        # made anew each round lives from one move to the next and is promoted to the collector's oldest generation)
        self.resident_views: dict[int, ViewRecord] = {}
        self.resident_alive = 0  # how many of them were alive at the last sweep for dead ones
        self._dropped: dict[int, tuple[StorageWeakRef, int]] = {}  # freed without a copy: size to regrow
        # per optimizer whose state offload_optimizer moved here: name -> the state tensor offloaded under it (weakly),
        # so that reload_optimizer refuses a state entry swapped for another tensor meanwhile
        self.optimizer_states: weakref.WeakKeyDictionary[object, dict[str, weakref.ref]] = weakref.WeakKeyDictionary()
        self.reserve_wait_s = checked_seconds(reserve_wait_s, "HostArena(reserve_wait_s)")
        self._pending: list[Reservation] = []  # background reservations not settled yet
        self._chunks_lock = threading.Lock()  # a background thread appends its chunk
        self._settle_lock = threading.Lock()  # wait() may run in another thread than the offload
        self._finalizer = weakref.finalize(self, _release_chunks, self._chunks, self.pinned)

    @property
    def nbytes(self) -> int:
        """Host bytes this arena holds (allocated), whether or not they hold data now."""
        return sum(chunk.numel() for chunk in self._chunks)

    @property
    def held_bytes(self) -> int:
        """Bytes of offloaded data the arena holds right now."""
        return sum(slot.nbytes for slot in self._slots.values() if slot.holds_data)

    @property
    def chunks(self) -> int:
        """How many host allocations back the arena (grows only when new storages appear)."""
        return len(self._chunks)

    def slot_of(self, storage: torch.UntypedStorage) -> Slot | None:
        """The slot serving ``storage``, if it has one and that storage is still alive."""
        slot = self._slots.get(storage._cdata)
        if slot is None or slot.expired():
            return None
        return slot

    def reserve(self, storages: Iterable[torch.UntypedStorage], *, background: bool = False) -> int | Reservation:
        """Give every storage without a slot one, sized to its current bytes; returns bytes allocated.

        Call ahead of the first offload to take the allocation and pinning off the critical path.
        All or nothing: if the host allocation (or its pinning) fails, the arena is left exactly
        as it was (no slot registered, no dead slot handed out), so a retry cannot give two
        storages the same host bytes.

        ``background=True`` allocates and pins in a worker thread and returns a ``Reservation``
        at once (``wait(timeout_s)``, ``done()``, ``exception()``), e.g. while training runs. The
        next offload or synchronous ``reserve`` first waits for it, at most ``reserve_wait_s``,
        and raises its error if it failed (once; the arena stays usable and as it was).
        """
        if background:
            return self._reserve_in_background(storages)
        self._settle_all(self.reserve_wait_s, "HostArena(reserve_wait_s=...)")
        missing = self._missing(storages, planned=set())
        reused = self._plan_dead_slot_reuse(missing)
        fresh = _small_last([storage for storage in missing if storage._cdata not in reused])
        offsets, total = _layout(storage.nbytes() for storage in fresh)
        # allocate before touching any bookkeeping: a failure here must leave nothing behind
        chunk = self._allocate(total, len(fresh)) if fresh else None
        for storage in missing:
            slot_key = reused.get(storage._cdata)
            if slot_key is not None:
                self._hand_over(slot_key, StorageWeakRef(storage), storage._cdata)
        if chunk is not None:
            chunk_index = self._append_chunk(chunk)
            for storage, offset in zip(fresh, offsets):
                self._slots[storage._cdata] = Slot(chunk_index, offset, storage.nbytes(), StorageWeakRef(storage))
            logger.debug("HostArena: allocated %d bytes for %d new storages", total, len(fresh))
        return total

    def _missing(self, storages: Iterable[torch.UntypedStorage], planned: set[int]) -> list[torch.UntypedStorage]:
        """The storages (once each, non-empty) that have no slot and are not in a pending reservation."""
        missing: list[torch.UntypedStorage] = []
        seen: set[int] = set()
        for storage in storages:
            key = storage._cdata
            if key in seen or key in planned or storage.nbytes() == 0 or self.slot_of(storage) is not None:
                continue
            seen.add(key)
            missing.append(storage)
            self._rekey_dead(key)
        return missing

    def _reserve_in_background(self, storages: Iterable[torch.UntypedStorage]) -> Reservation:
        planned = {key for pending in self._pending for key in pending.keys}
        missing = self._missing(storages, planned)
        reused = self._plan_dead_slot_reuse(missing)
        handed: list[tuple[int, StorageWeakRef, int]] = []
        for storage in missing:
            slot_key = reused.get(storage._cdata)
            if slot_key is not None:
                # a key no live storage can get, so the promise survives until the reservation settles
                slot = self._slots.pop(slot_key)
                self._slots[-id(slot)] = slot
                handed.append((storage._cdata, StorageWeakRef(storage), -id(slot)))
        fresh = _small_last([storage for storage in missing if storage._cdata not in reused])
        offsets, total = _layout(storage.nbytes() for storage in fresh)
        entries = [(s._cdata, StorageWeakRef(s), offset, s.nbytes()) for s, offset in zip(fresh, offsets)]
        reservation = Reservation(self, entries, handed, total)
        self._pending.append(reservation)
        reservation._start()
        return reservation

    def _settle(self, reservation: Reservation, timeout_s: float, knob: str, bound_s: float | None = None) -> None:
        """Wait (bounded) for ``reservation``'s thread, then register its slots or raise its failure.

        ``bound_s``: the knob's value when ``timeout_s`` is what is left of it (for the message).
        """
        if not reservation._finished.wait(timeout_s):
            timeout_s = timeout_s if bound_s is None else bound_s
            raise ReserveTimeout(
                f"HostArena: the background reservation of {reservation.nbytes} host bytes for "
                f"{reservation.storages} storages did not finish allocating and pinning within {timeout_s:g} s; "
                f"nothing of it is registered yet and it keeps running: wait again or raise {knob}"
            )
        with self._settle_lock:
            if reservation in self._pending:
                self._pending.remove(reservation)
                if reservation._error is None:
                    self._commit(reservation)
        error = reservation._error
        if error is not None:
            raise RefitError(
                f"HostArena.reserve(background=True) failed in its thread ({error}); the arena is as it was "
                "before that call and stays usable: the next offload allocates on the critical path"
            ) from error

    def _settle_all(self, timeout_s: float, knob: str) -> None:
        """Settle every pending background reservation within one deadline; raise the first failure.

        A failure does not stop the others from settling: one left pending would register its
        slots after a ``release()`` into chunk indices that by then belong to other storages.
        """
        deadline = time.monotonic() + timeout_s
        first: RefitError | None = None
        for reservation in list(self._pending):
            try:
                self._settle(reservation, max(deadline - time.monotonic(), 1e-3), knob, timeout_s)
            except ReserveTimeout:
                raise
            except RefitError as error:
                first = first or error
        if first is not None:
            raise first

    def _commit(self, reservation: Reservation) -> None:
        for key, ref, slot_key in reservation._handed:
            if ref.expired():
                continue  # the storage died meanwhile: the dead slot stays free for another
            self._rekey_dead(key)
            self._hand_over(slot_key, ref, key)
        for key, ref, offset, nbytes in reservation._fresh:
            slot = Slot(reservation._chunk_index or 0, offset, nbytes, ref)
            if ref.expired():  # its key may belong to a new storage by now: file the slot as dead
                slot.storage_ref = None
                self._slots[-id(slot)] = slot
            else:
                self._rekey_dead(key)
                self._slots[key] = slot
        logger.debug("HostArena: background reservation of %d bytes registered", reservation.nbytes)

    def _append_chunk(self, chunk: torch.Tensor) -> int:
        with self._chunks_lock:
            self._chunks.append(chunk)
            return len(self._chunks) - 1

    def _allocate(self, nbytes: int, storages: int) -> torch.Tensor:
        try:
            return _allocate_chunk(nbytes, self.pinned)
        except RefitError:
            raise
        except Exception as error:  # the host allocator's out-of-memory is a bare RuntimeError
            raise RefitError(
                f"HostArena: allocating {nbytes} host bytes for {storages} storages failed ({error}); nothing "
                "was reserved and nothing moved: free host memory (or raise the process's memory limit) and retry"
            ) from error

    def _plan_dead_slot_reuse(self, storages: list[torch.UntypedStorage]) -> dict[int, int]:
        """Which dead slot (by key) each storage can take over, so churn does not grow the arena."""
        promised = {key for pending in self._pending for key in pending.promised}
        free = [(k, slot.capacity_bytes) for k, slot in self._slots.items() if slot.expired() and k not in promised]
        plan: dict[int, int] = {}
        for storage in storages:
            need = storage.nbytes()
            for index, (key, capacity) in enumerate(free):
                if capacity >= need:
                    plan[storage._cdata] = key
                    del free[index]
                    break
        return plan

    def _rekey_dead(self, key: int) -> None:
        """Move a dead storage's slot off ``key`` (a new storage may reuse the old one's address)."""
        slot = self._slots.get(key)
        if slot is not None and slot.expired():
            del self._slots[key]
            self._slots[-id(slot)] = slot

    def _hand_over(self, slot_key: int, ref: StorageWeakRef, key: int) -> None:
        slot = self._slots.pop(slot_key)
        slot.storage_ref = ref
        slot.holds_data, slot.nbytes = False, 0
        self._slots[key] = slot

    def remember_dropped(self, storage: torch.UntypedStorage) -> None:
        """Note the size of a storage freed without a copy, so it can be regrown later."""
        self._dropped = {k: v for k, v in self._dropped.items() if not v[0].expired()}
        self._dropped[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())

    def dropped_size(self, storage: torch.UntypedStorage) -> int | None:
        """The size a dropped storage had (and forget it), or None if it was not dropped here."""
        entry = self._dropped.pop(storage._cdata, None)
        if entry is None or entry[0].expired():
            return None
        return entry[1]

    def forget(self, storage: torch.UntypedStorage) -> None:
        """Drop ``storage``'s slot (its bytes stay allocated for reuse by another storage that fits)."""
        slot = self._slots.pop(storage._cdata, None)
        if slot is not None:
            slot.storage_ref = None
            self._slots[-id(slot)] = slot  # a key no live storage has

    def host_bytes(self, slot: Slot, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of a slot's host memory as a flat uint8 tensor."""
        return self._chunks[slot.chunk][slot.offset : slot.offset + nbytes]

    def release(self) -> None:
        """Free all host memory now; refuses while any slot still holds offloaded data."""
        try:
            self._settle_all(self.reserve_wait_s, "HostArena(reserve_wait_s=...)")
        except ReserveTimeout:
            raise
        except RefitError as error:  # a failed background reservation left nothing to free
            logger.debug("HostArena.release(): %s", error)
        holding = [slot for slot in self._slots.values() if slot.holds_data and not slot.expired()]
        if holding:
            raise RefitError(
                f"HostArena.release(): {len(holding)} storages ({sum(s.nbytes for s in holding)} bytes) "
                "are still offloaded here; reload them first"
            )
        if self.pinned:
            # A deferred reload's slots are free once its copies are queued, not done. CUDA does not document
            # that unregistering pinned pages waits for copies still reading them (on the H200 it did), so wait.
            for device in {slot.device for slot in self._slots.values() if slot.device.type == "cuda"}:
                torch.cuda.synchronize(device)
        self._slots.clear()
        self.views.clear()
        self.resident_views.clear()
        self.resident_alive = 0
        self._dropped.clear()
        self.optimizer_states.clear()
        _release_chunks(self._chunks, self.pinned)

    def __repr__(self) -> str:
        return (
            f"HostArena(pinned={self.pinned}, nbytes={self.nbytes}, chunks={self.chunks}, held_bytes={self.held_bytes})"
        )


# -- Reservation: a background ``HostArena.reserve``, its host bytes allocated and pinned in a thread ---


class Reservation:
    """A ``HostArena.reserve(..., background=True)`` in flight: host bytes allocated and pinned in a thread.

    Its slots are registered with the arena when it is settled: by ``wait()``, or by the next
    offload (or synchronous reserve) of the arena, whichever comes first.
    """

    def __init__(
        self,
        arena: HostArena,
        fresh: list[tuple[int, StorageWeakRef, int, int]],
        handed: list[tuple[int, StorageWeakRef, int]],
        nbytes: int,
    ) -> None:
        self.nbytes = nbytes  # fresh host bytes this reservation allocates
        self.storages = len(fresh) + len(handed)
        self.seconds = 0.0  # how long the thread took to allocate and pin
        self._arena = arena
        self._fresh = fresh  # (storage key, weak ref, offset, bytes)
        self._handed = handed  # (storage key, weak ref, dead slot's key): reused without allocating
        # the caller's current device: cudaHostRegister in the thread must run in the same context
        self._device_index = torch.cuda.current_device() if arena.pinned else None
        self._chunk_index: int | None = None
        self._error: BaseException | None = None
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._allocate, name="refitkit-arena-reserve", daemon=True)

    @property
    def keys(self) -> set[int]:
        return {entry[0] for entry in self._fresh} | {entry[0] for entry in self._handed}

    @property
    def promised(self) -> set[int]:
        return {entry[2] for entry in self._handed}

    def _start(self) -> None:
        self._thread.start()

    def _allocate(self) -> None:
        start = time.perf_counter()
        try:
            if self._device_index is not None:
                torch.cuda.set_device(self._device_index)  # per thread: a new thread starts on device 0
            if self._fresh:
                chunk = self._arena._allocate(self.nbytes, len(self._fresh))
                self._chunk_index = self._arena._append_chunk(chunk)
        except BaseException as error:  # surfaced in the caller's thread by wait() / the next offload
            self._error = error
        finally:
            self.seconds = time.perf_counter() - start
            self._finished.set()

    def done(self) -> bool:
        """Whether the thread finished (successfully or not); never blocks."""
        return self._finished.is_set()

    def exception(self) -> BaseException | None:
        """The thread's failure once it finished (None while running or when it succeeded)."""
        return self._error if self._finished.is_set() else None

    def wait(self, timeout_s: float) -> int:
        """Block until the bytes are allocated and pinned, at most ``timeout_s``; returns the bytes allocated.

        Raises ``ReserveTimeout`` naming ``timeout_s`` (the reservation keeps running and can be
        waited on again), or a ``RefitError`` carrying the thread's failure.
        """
        timeout = checked_seconds(timeout_s, "Reservation.wait(timeout_s)")
        self._arena._settle(self, timeout, "Reservation.wait(timeout_s)")
        return self.nbytes

    def __repr__(self) -> str:
        state = "failed" if self.exception() is not None else "done" if self.done() else "running"
        return f"Reservation({state}, nbytes={self.nbytes}, storages={self.storages})"
