"""Reservation: a background ``HostArena.reserve``, its host bytes allocated and pinned in a thread."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from refitkit._knobs import checked_seconds

if TYPE_CHECKING:
    from refitkit.offload.arena import HostArena


class Reservation:
    """A ``HostArena.reserve(..., background=True)`` in flight: host bytes allocated and pinned in a thread.

    Its slots are registered with the arena when it is settled: by ``wait()``, or by the next
    offload (or synchronous reserve) of the arena, whichever comes first.
    """

    def __init__(
        self,
        arena: "HostArena",
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
