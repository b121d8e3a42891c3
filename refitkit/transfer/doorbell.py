"""Progress counters in shared memory: how bucket hand-offs avoid a socket round trip.

Each bucket needs two hand-offs: the sender says "its bytes are complete" and the receiver says
"I am done reading it". Over ZMQ each one costs a wake-up of the peer's I/O thread and then of
its user thread: 0.2-0.35 ms per message was measured inside a sync on the H200 machine (a
microVM), i.e. most of the gap between a 2 GiB-bucket sync and its copy time. Here each
hand-off is one 8-byte store into a 4 KiB segment that the waiter watches:

- word ``PACKED``: buckets whose bytes are complete (the sender stores ``seq + 1`` once the
  copies into bucket ``seq`` finished; bucket frames travel over ZMQ ahead of that, so their
  metadata is parsed while the copies run);
- word ``CONSUMED``: buckets the receiver is done with (it stores ``seq + 1`` once its reads
  of bucket ``seq`` finished, so the sender may overwrite that half).

Only counters cross this segment: no pointers, no objects, nothing executable. Frames that
carry meaning (setup, bucket metadata, the final ACK, errors, aborts) stay on the socket.

Ordering: the writer stores the counter after the data it announces is complete (a CPU copy
returned, or a CUDA event completed), and the reader reads the data only after it saw the
counter. That relies on x86-64's total store order for the counter and the bytes written
before it (Python has no portable fence); the segment is refused on other architectures,
where the sender falls back to the socket for both hand-offs (``available()``).

Waiting: callers spin on ``read`` for a short budget and then block on their socket with a
1 ms poll between reads (``wait_slice_ms``), always against a deadline, so a dead peer still
ends in ``TransferTimeout``; the timed poll is only how long one look waits, never what
orders anything.
"""

from __future__ import annotations

import mmap
import os
import platform
from typing import Any

from refitkit.errors import ProtocolError
from refitkit.transfer import shm

MAGIC = 0x52454649544B4954  # "REFITKIT"
PACKED = 1
CONSUMED = 2
CONTROL_BYTES = 4096
SPIN_S = 0.002  # spin this long before a waiter starts blocking on its socket between looks
WAIT_SLICE_MS = 1  # one blocking look at the socket while waiting for a counter


def available() -> bool:
    """Whether counters in shared memory are safely ordered on this machine (x86-64 only)."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(shm.SHM_DIR)


class Doorbell:
    """The two progress counters of one session, in a small shared-memory segment."""

    def __init__(self, path: str, mapping: mmap.mmap, *, owner: bool) -> None:
        self.path = path
        self._mmap: mmap.mmap | None = mapping
        self._words: memoryview | None = memoryview(mapping).cast("Q")
        self._owner = owner

    @classmethod
    def create(cls, session: str) -> "Doorbell":
        """The sender's segment for ``session`` (named so a dead sender's leftover is cleaned like a bucket's)."""
        path = os.path.join(shm.SHM_DIR, f"{shm.segment_prefix()}{os.getpid()}-{session}c")
        bell = cls(path, shm.map_segment(path, CONTROL_BYTES, create=True), owner=True)
        assert bell._words is not None
        bell._words[0] = MAGIC
        return bell

    @classmethod
    def open(cls, handle: Any) -> "Doorbell":
        """The receiver's view of the sender's segment, from the ``control`` field of setup."""
        if not isinstance(handle, str):
            raise ProtocolError(f"setup: control segment {handle!r} is not a path")
        shm.check_segment_path(handle)
        bell = cls(handle, shm.map_segment(handle, CONTROL_BYTES, create=False), owner=False)
        assert bell._words is not None
        if bell._words[0] != MAGIC:
            bell.close()
            raise ProtocolError(f"setup: {handle} is not a refitkit control segment")
        return bell

    def handle(self) -> str:
        return self.path

    def read(self, word: int) -> int:
        assert self._words is not None, "doorbell used after close()"
        return self._words[word]

    def write(self, word: int, value: int) -> None:
        assert self._words is not None, "doorbell used after close()"
        self._words[word] = value

    def unlink(self) -> None:
        """Drop the name (both sides keep their mapping); idempotent."""
        if self._owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        """Unmap (and, on the sender, unlink); idempotent."""
        self.unlink()
        words, self._words = self._words, None
        if words is not None:
            words.release()
        mapping, self._mmap = self._mmap, None
        if mapping is not None:
            mapping.close()
