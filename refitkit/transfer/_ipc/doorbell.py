"""Bucket hand-offs through process-shared semaphores, posted by the GPU stream itself.

Each bucket needs two hand-offs: the sender says "its bytes are complete" and the receiver says
"I am done reading it". Over ZMQ each one costs a wake-up of the peer's I/O thread and then of
its user thread: 0.2-0.35 ms per message was measured inside a sync on the H200 machine (a
microVM), most of the gap between a 2 GiB-bucket sync and its copy time. Worse, the side that
announces must first notice that its own copies finished, which a Python thread only does when
it looks (and not while it is inside the caller's loader).

Here each hand-off is a POSIX semaphore in a 4 KiB shared-memory segment (``sem_init`` with
``pshared=1``):

- ``PACKED`` is posted once per bucket whose bytes are complete;
- ``CONSUMED`` is posted once per bucket the receiver finished reading, except the last; for that
  one it is posted once the receiver released every view and its mapping (the final ACK, which
  the ``released`` frame repeats): the sender may free the buffer when the count reaches the
  number of buckets it sent.

On CUDA the post is queued on the stream that did the copies (``cuLaunchHostFunc`` with
``sem_post`` itself as the host function, so no Python and no GIL are involved): it happens the
moment the GPU gets there, whatever the process's Python thread is doing. CPU copies are
synchronous, so the CPU side posts directly. ``sem_post`` / ``sem_wait`` are full memory
barriers, so the bytes written before a post are visible after the matching wait on any
architecture.

What can go wrong is bounded. A peer that dies simply stops posting: waits use
``sem_timedwait`` in slices against the caller's deadline (a post ends a slice at once; slices
grow from 1 ms to 50 ms, so a long wait costs next to no CPU), and look at the socket in between
for error and abort frames and for the peer's connection (``liveness``): a dead peer ends the
wait within a slice. A process never waits on anything its peer owns except
these counters: no CUDA object crosses the process boundary, so a killed peer cannot leave one of
our streams waiting forever. A host function posts into our own mapping, which is unmapped only
after the stream that holds the host function was synchronized.

Only counters cross this segment: no pointers, no objects, nothing executable. Frames that
carry meaning (setup, bucket metadata, errors, aborts, and the final ACK, whose count here is
only its early twin) stay on the socket.
What a same-uid peer can do: anyone running as our uid can open or map the segment (and the bucket)
and write over it. It can always disrupt a session (post too often, never post, truncate the file);
it must not make us loop unboundedly, crash, or touch memory outside our buffers. So every loop over
a counter takes at most what the protocol allows (``PACKED``: ``MAX_IN_FLIGHT`` buckets beyond those
consumed, the two halves and two direct buckets; ``CONSUMED``: one per bucket sent) and calls a count
beyond it a ProtocolError, and before each call into glibc the semaphore's words are checked against what ``sem_init`` wrote
(glibc's 64-bit layout: a value/waiters word, then ``private``): glibc aborts the process on a
futex error caused by a garbage ``private``, and a value of 4e9 would be 4e9 turns. A post queued
on a CUDA stream runs ``sem_post`` unchecked; a scribble landing in that window can still make
glibc abort. Truncating the file makes the next access a SIGBUS (sealed memfds would prevent that;
the segment is unlinked as soon as both sides mapped it, which narrows who can reach it).

Without the C library's semaphores (``available()`` is False), or when the receiver does not see
the sender's shared-memory filesystem (``shm_identity()`` differs), the hand-offs travel as
``packed`` / ``done`` frames instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import mmap
import os
import struct
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from refitkit.errors import ProtocolError, TransferError
from refitkit.transfer._ipc import shm
from refitkit.transfer.common import SessionPhase
from refitkit.transfer.protocol import timeout_error

MAGIC = 0x52454649544B4954  # "REFITKIT"
PACKED = 0
CONSUMED = 1
CONTROL_BYTES = 4096
_SEM_OFFSETS = (64, 128)  # sem_t is 32 bytes on x86-64 and 32 on aarch64 glibc; each gets a cache line
SPIN_S = 0.002  # spin this long before a waiter sleeps in sem_timedwait slices
WAIT_SLICE_S = 0.001  # the first sleeping look; the socket is looked at between slices
# The longest one (each is twice the one before): a post or a frame ends a slice at once, so this only bounds how
# late a wait looks at the socket (error and abort frames, the peer's connection) while nothing comes.
MAX_WAIT_SLICE_S = 0.05
# No semaphore has more announcements pending than a few (MAX_IN_FLIGHT buckets, then the final ACK):
# a larger value is a peer writing over the segment, refused before glibc counts it down 4e9 times.
MAX_PENDING = 16
_NAMES = ("PACKED", "CONSUMED")


def event_after(stream: Any) -> Any:
    """The frame fallback's marker: a CUDA event after the work queued on ``stream`` (None: CPU work, done)."""
    if stream is None:
        return None
    import torch

    event = torch.cuda.Event()
    event.record(stream)
    return event


def announce_finished(pending: deque[tuple[int, Any]], announce: Callable[[int], None]) -> None:
    """The frame fallback: ``announce(seq)``, in order, for each pending bucket whose CUDA event (or
    None: nothing to wait for) has completed; stops at the first that has not (never waits)."""
    while pending:
        seq, event = pending[0]
        if event is not None and not event.query():
            return
        pending.popleft()
        announce(seq)


def wait_until(
    ready: Callable[[], bool],
    look: Callable[[float], None],
    *,
    timeout_s: float,
    phase: SessionPhase,
    waiting_for: str,
    peer: str,
) -> None:
    """Until ``ready()``: spin (yielding the core) for ``SPIN_S``, calling ``look(0.0)`` every 32 tries,
    then ``look(slice_s)`` between tries, where ``look`` may sleep up to ``slice_s`` on a semaphore or
    the socket (slices grow from ``WAIT_SLICE_S`` to ``MAX_WAIT_SLICE_S``); TransferTimeout (naming
    ``phase``, ``waiting_for``, ``peer`` and the knob) once ``timeout_s`` has passed."""
    began = time.perf_counter()
    spin_until, deadline = began + SPIN_S, began + timeout_s
    tries = 0
    slice_s = WAIT_SLICE_S
    while not ready():
        now = time.perf_counter()
        if now >= deadline:
            raise timeout_error(phase, waiting_for, peer, timeout_s)
        if now < spin_until:
            tries += 1
            if tries % 32:
                os.sched_yield()  # spinning must not starve the peer or either side's ZMQ I/O thread of a core
            else:
                look(0.0)
            continue
        look(min(slice_s, deadline - now))
        slice_s = min(2 * slice_s, MAX_WAIT_SLICE_S)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
        for fn in ("sem_init", "sem_post", "sem_trywait", "sem_timedwait"):
            getattr(lib, fn).restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    lib.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
    lib.sem_post.argtypes = [ctypes.c_void_p]
    lib.sem_trywait.argtypes = [ctypes.c_void_p]
    lib.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]
    if hasattr(lib, "sem_clockwait"):  # glibc >= 2.30: a deadline on the monotonic clock
        lib.sem_clockwait.restype = ctypes.c_int
        lib.sem_clockwait.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Timespec)]
    return lib


@functools.lru_cache(maxsize=1)
def _sem_layout() -> tuple[int, int] | None:
    """(value/waiters word, ``private`` word) of a fresh process-shared semaphore, as glibc's 64-bit
    layout stores them, or None where that layout cannot be read (then no field checks)."""
    lib = _libc()
    if lib is None or sys.maxsize < 2**63 - 1 or sys.byteorder != "little":
        return None
    scratch = ctypes.create_string_buffer(64)
    if lib.sem_init(scratch, 1, 0) != 0:
        return None
    word, private = struct.unpack_from("<QI", scratch.raw)
    return (word, private) if word == 0 else None


def available() -> bool:
    """Whether process-shared semaphores (glibc's sem_* on Linux) can carry the hand-offs here."""
    return _libc() is not None and os.path.isdir(shm.SHM_DIR)


def shm_identity() -> list[int] | None:
    """Which shared-memory filesystem this process sees (device and inode of its directory).

    Two processes can share a semaphore segment only if they see the same one; containers that
    share the trainer's socket directory but not its /dev/shm (the cuda_ipc transport needs no
    /dev/shm otherwise) get the frame fallback instead of a segment they cannot open.
    """
    try:
        info = os.stat(shm.SHM_DIR)
    except OSError:
        return None
    return [info.st_dev, info.st_ino]


@functools.lru_cache(maxsize=1)
def _launch_host_func() -> tuple[Any, int]:
    """cuLaunchHostFunc from the CUDA driver, and sem_post's address as the host function."""
    from refitkit.transfer._ipc.cuda_ipc import _driver

    driver = _driver()
    fn = driver.cuLaunchHostFunc
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    libc = _libc()
    if libc is None:
        raise TransferError("cuLaunchHostFunc needs sem_post from the C library, which this process lacks")
    return fn, ctypes.cast(libc.sem_post, ctypes.c_void_p).value  # type: ignore[return-value]


class Doorbell:
    """The two hand-off semaphores of one session, in a small shared-memory segment."""

    def __init__(self, path: str, mapping: mmap.mmap, *, owner: bool) -> None:
        self.path = path
        self._mmap: mmap.mmap | None = mapping
        self._anchor: Any = ctypes.c_char.from_buffer(mapping)  # pins the mapping while semaphores are in use
        base = ctypes.addressof(self._anchor)
        self._sems = tuple(base + offset for offset in _SEM_OFFSETS)
        self._owner = owner
        self._libc = _libc()
        self._post_streams: dict[int, Any] = {}  # CUDA streams with a post queued: synchronized before unmapping
        self._segment: shm.Segment | None = None  # the sender's: it holds the name (or memfd) until unlink()

    @classmethod
    def create(cls, session: str, *, peer_pidns: Any = None) -> Doorbell:
        """The sender's segment for ``session``: a sealed memfd when the receiver's hello gave our PID
        namespace as ``peer_pidns``, else named (and swept like a bucket's if the sender dies)."""
        libc = _libc()
        if libc is None:
            raise TransferError("no process-shared semaphores: this process's C library lacks sem_init")
        segment = shm.Segment(CONTROL_BYTES, name=f"{session}c", peer_pidns=peer_pidns)
        bell = cls(segment.path or segment.name, segment.mapping, owner=True)
        bell._segment = segment
        for sem in bell._sems:
            if libc.sem_init(sem, 1, 0) != 0:
                bell.close()
                raise TransferError(f"sem_init failed: {os.strerror(ctypes.get_errno())}")
        segment.mapping[:8] = MAGIC.to_bytes(8, "little")
        return bell

    @classmethod
    def open(cls, handle: Any) -> Doorbell:
        """The receiver's view of the sender's segment, from the ``control`` field of setup."""
        if _libc() is None:
            raise TransferError("the sender uses shared semaphores, which this process's C library lacks")
        if not isinstance(handle, dict) or handle.get("nbytes") != CONTROL_BYTES:
            raise ProtocolError(f"setup: control segment {handle!r} is not a {CONTROL_BYTES}-byte segment handle")
        mapping = shm.open_segment(handle, what="control segment")
        path = handle.get("path")  # None for a memfd: nothing to unlink
        bell = cls(path, mapping, owner=False)  # type: ignore[arg-type]
        if int.from_bytes(mapping[:8], "little") != MAGIC:
            bell.close()
            raise ProtocolError(f"setup: {path or handle.get('name')} is not a refitkit control segment")
        return bell

    def handle(self) -> dict[str, Any]:
        if self._segment is None:
            raise TransferError("only the sender's doorbell has a handle to give")
        return self._segment.handle()

    # -- posting ----------------------------------------------------------------------------------

    def check(self, which: int) -> None:
        """ProtocolError unless semaphore ``which`` still looks like what sem_init made: its ``private``
        word unchanged, at most one waiter (the one process that waits on it) and at most
        ``MAX_PENDING`` announcements pending. Called before every call into glibc."""
        layout = _sem_layout()
        if layout is None or self._mmap is None:
            return
        word, private = struct.unpack_from("<QI", self._mmap, _SEM_OFFSETS[which])
        value, waiters = word & 0xFFFFFFFF, word >> 32
        if private != layout[1] or waiters > 1 or value > MAX_PENDING:
            raise ProtocolError(
                f"control segment {self.path}: semaphore {_NAMES[which]} was written over (value {value}, "
                f"waiters {waiters}, private {private:#x}; at most {MAX_PENDING} pending, 1 waiter, private "
                f"{layout[1]:#x}): another process of this uid is interfering with the session"
            )

    def post(self, which: int) -> None:
        """Announce one more bucket now (the data it stands for is complete)."""
        if self._libc is None:
            raise TransferError("the C library's semaphores are unavailable in this process")
        self.check(which)
        if self._libc.sem_post(self._sems[which]) != 0:
            raise TransferError(f"sem_post failed: {os.strerror(ctypes.get_errno())}")

    def post_when_done(self, which: int, stream: Any) -> None:
        """Announce once the work queued on ``stream`` ran; at once when ``stream`` is None (CPU work is
        done) or has nothing pending (a query costs microseconds; a host function's run is noticed by
        the driver's callback thread, 0.1-0.4 ms later on the H200 machine). A stream that is idle
        has also run every post queued on it before, so announcements stay in order."""
        if stream is None or stream.query():
            self.post(which)
        else:
            self.post_after(which, stream)

    def post_after(self, which: int, stream: Any) -> None:
        """Announce one more bucket when ``stream`` (a torch.cuda.Stream) reaches this point."""
        import torch

        self.check(which)
        launch, sem_post = _launch_host_func()
        self._post_streams.setdefault(stream.cuda_stream, stream)
        with torch.cuda.device(stream.device):  # the driver call uses the thread's current context
            result = launch(stream.cuda_stream, sem_post, self._sems[which])
        if result != 0:
            raise TransferError(f"cuLaunchHostFunc failed: CUDA error {result}")

    def synchronize_posts(self) -> None:
        """Wait until every post queued on a CUDA stream has run."""
        for stream in self._post_streams.values():
            stream.synchronize()

    # -- waiting ----------------------------------------------------------------------------------

    def take(self, which: int, timeout_s: float = 0.0) -> bool:
        """Consume one announcement: at once when ``timeout_s`` is 0, else waiting up to ``timeout_s``."""
        if self._libc is None:
            raise TransferError("the C library's semaphores are unavailable in this process")
        self.check(which)
        sem = self._sems[which]
        if timeout_s <= 0.0:
            return self._libc.sem_trywait(sem) == 0
        clockwait = getattr(self._libc, "sem_clockwait", None)
        # The monotonic clock where the C library takes it (a wall-clock step cannot stretch the wait).
        deadline = (time.monotonic() if clockwait is not None else time.time()) + timeout_s
        spec = _Timespec(int(deadline), int((deadline % 1.0) * 1e9))
        while (
            clockwait(sem, time.CLOCK_MONOTONIC, ctypes.byref(spec))
            if clockwait is not None
            else self._libc.sem_timedwait(sem, ctypes.byref(spec))
        ) != 0:
            err = ctypes.get_errno()
            if err == errno.ETIMEDOUT:
                return False
            if err != errno.EINTR:
                raise TransferError(f"sem_timedwait failed: {os.strerror(err)}")
        return True

    # -- lifetime ---------------------------------------------------------------------------------

    def unlink(self) -> None:
        """Drop the name or memfd descriptor (both sides keep their mapping); idempotent."""
        if self._segment is not None:
            self._segment.unlink()

    def close(self) -> None:
        """Unmap (and, on the sender, unlink) once every queued post has run.

        A post that could still run would write into unmapped memory: if the streams cannot be
        synchronized, the 4 KiB mapping is left in place (and the error raised) rather than unmapped.
        """
        if self._owner:
            self.unlink()
        if self._mmap is None:
            return
        self.synchronize_posts()
        self._post_streams.clear()
        self._anchor = None
        mapping, self._mmap = self._mmap, None
        mapping.close()
