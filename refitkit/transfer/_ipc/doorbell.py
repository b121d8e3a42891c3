"""Bucket hand-offs through named POSIX semaphores, posted by the GPU stream itself.

Each bucket needs two hand-offs: the sender says "its bytes are complete" and the receiver says
"I am done reading it". Over ZMQ each one costs a wake-up of the peer's I/O thread and then of
its user thread, and the side that announces must first notice that its own copies finished,
which a Python thread only does when it looks (and not while it is inside the caller's loader).

Here each hand-off is a named POSIX semaphore that the C library makes, lays out and keeps in its own
file (``sem_open``; glibc's ``/dev/shm/sem.<name>``). refitkit calls only the public ``sem_*`` functions
and never reads or writes a semaphore's memory:

- ``PACKED`` is posted once per bucket whose bytes are complete;
- ``CONSUMED`` is posted once per bucket the receiver finished reading, except the last; for that
  one it is posted once the receiver released every view and its mapping (the final ACK, which
  the ``released`` frame repeats): the sender may free the buffer when the count reaches the
  number of buckets it sent.

On CUDA the post is queued on the stream that did the copies (``cuLaunchHostFunc`` with
``sem_post`` itself as the host function and the ``sem_t *`` that ``sem_open`` returned as its
argument, so no Python and no GIL are involved): it happens the moment the GPU gets there, whatever
the process's Python thread is doing. CPU copies are synchronous, so the CPU side posts directly.
``sem_post`` / ``sem_wait`` are full memory barriers, so the bytes written before a post are visible
after the matching wait on any architecture.

Names and lifetime. The sender makes both semaphores (``O_EXCL``, mode 0600) under a fresh random name
that carries its uid and pid (``refitkit-<uid>-<pid>-<32 hex>-packed`` / ``-consumed``) and holds an
``flock`` on each file while the name exists. The receiver opens both names from the setup and unlinks
them at once; the sender drops them at ``ready`` or when the session ends, whichever comes first. A
sender SIGKILLed before that leaves the files behind: the next sender's sweep
(``shm.remove_stale_segments``) removes this uid's whose lock is free.

Waits block in the kernel (``sem_clockwait``) with the caller's deadline, in slices of ``SEM_SLICE_S``
between which the socket is looked at for error and abort frames; nothing spins unless
``REFITKIT_SPIN_US`` asks for it (``SPIN_S``). A peer that dies simply stops posting; its connection's end
(``liveness``) is seen between two slices and ends the wait with ``PeerGone``. A process never waits on anything its peer owns except these counters: no CUDA
object crosses the process boundary, so a killed peer cannot leave one of our streams waiting forever.
A host function posts into our own mapping, which is closed only after the stream that holds the host
function was synchronized.

Only counts cross: no pointers, no objects, nothing executable. Frames that carry meaning (setup,
bucket metadata, errors, aborts, and the final ACK, whose count here is only its early twin) stay
on the socket. What a same-uid process can do: post too often (every loop over a count takes at most
what the protocol allows, ``MAX_IN_FLIGHT`` buckets beyond those consumed for ``PACKED``, one per bucket
sent for ``CONSUMED``, and calls a count beyond it a ProtocolError), never post (the wait times out), or,
in the few milliseconds a name exists (from the sender's ``sem_open`` to the receiver's unlink), open
the file and write over or truncate it: glibc may then abort the process in a wait, or the next access
be a SIGBUS. That window is the price of never reading the C library's private layout. Other uids are
kept out by the file mode.

Without the C library's semaphores (``available()`` is False), or when the receiver does not see
the sender's shared-memory filesystem (``shm_identity()`` differs), the hand-offs travel as
``packed`` / ``done`` frames instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import functools
import math
import os
import re
import secrets
import stat
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from refitkit.errors import InvalidInput, ProtocolError, TransferError
from refitkit.transfer._ipc import shm
from refitkit.transfer.common import SessionPhase
from refitkit.transfer.protocol import timeout_error

PACKED = 0
CONSUMED = 1
_SUFFIXES = ("packed", "consumed")  # the two names of a session, in the order of PACKED and CONSUMED
SPIN_ENV = "REFITKIT_SPIN_US"
# A semaphore wait looks at the socket (error and abort frames) this often: a failure frame is noticed within 50 ms,
# the bound a cancelled asend() has too, and a silent peer costs 20 wake-ups a second (each ~0.15 ms of CPU on the CPU
# machine, where 10 ms slices cost 1.3-2 % of a core). A post wakes the wait at once: slices add no latency to a sync.
SEM_SLICE_S = 0.05
# A wait with our own CUDA copies still to announce (the frame fallback) looks at their events this often: the
# announcement is at most 1 ms late, and the copies are ours, so the short slices last only while they run.
EVENT_SLICE_S = 0.001
_O_CREAT, _O_EXCL = os.O_CREAT, os.O_EXCL


def _spin_s_from_env() -> float:
    """``REFITKIT_SPIN_US`` in seconds: how long a wait looks without sleeping before it blocks (0, the default:
    it blocks in the kernel at once)."""
    raw = os.environ.get(SPIN_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        spin_us = int(raw)
    except ValueError:
        spin_us = -1
    if not 0 <= spin_us <= 1_000_000:
        raise InvalidInput(
            f"{SPIN_ENV}={raw!r}; need an int of microseconds from 0 to 1000000 (how long a transfer wait spins "
            "before it blocks; 0, the default, blocks at once)"
        )
    return spin_us / 1e6


SPIN_S = _spin_s_from_env()  # opt-in: spinning takes a core from the engine and the peer while it lasts


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
    ready: Callable[[], bool], look: Callable[[float], None], *, timeout_s: float, phase: SessionPhase,
    waiting_for: str, peer: str,
) -> None:  # fmt: skip
    """Until ``ready()``: ``look(left_s)`` blocks in the kernel for at most ``left_s`` (the time left to the
    deadline; it picks its own shorter slice where it must look at another source); TransferTimeout (naming
    ``phase``, ``waiting_for``, ``peer`` and the knob) once ``timeout_s`` has passed. With ``REFITKIT_SPIN_US``
    set, it first spins that long (yielding the core, ``look(0.0)`` every 32 tries)."""
    began = time.monotonic()
    deadline = began + timeout_s
    if SPIN_S > 0.0:
        spin_until, tries = began + min(SPIN_S, timeout_s), 0
        while not ready():
            tries += 1
            if tries % 32:
                os.sched_yield()  # spinning must not starve the peer or either side's ZMQ I/O thread of a core
            elif time.monotonic() >= spin_until:
                break
            else:
                look(0.0)
        else:
            return
    while not ready():
        left_s = deadline - time.monotonic()
        if left_s <= 0.0:
            raise timeout_error(phase, waiting_for, peer, timeout_s)
        look(left_s)


def poll_ms(wait_s: float) -> int:
    """A ZMQ poll's timeout for ``wait_s`` seconds, rounded up (a poll of 0 ms for 0.4 ms left would spin)."""
    return max(0, math.ceil(wait_s * 1000))


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    """The C library with its named-semaphore functions (ctypes releases the GIL during each call)."""
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
        for fn in ("sem_open", "sem_close", "sem_unlink", "sem_post", "sem_trywait", "sem_timedwait"):
            getattr(lib, fn)
    except (OSError, AttributeError):
        return None
    lib.sem_open.restype = ctypes.c_void_p  # sem_t *, NULL (SEM_FAILED) on failure
    lib.sem_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_uint]
    for fn, argtypes in (
        ("sem_close", [ctypes.c_void_p]),
        ("sem_unlink", [ctypes.c_char_p]),
        ("sem_post", [ctypes.c_void_p]),
        ("sem_trywait", [ctypes.c_void_p]),
        ("sem_timedwait", [ctypes.c_void_p, ctypes.POINTER(_Timespec)]),
    ):
        getattr(lib, fn).restype = ctypes.c_int
        getattr(lib, fn).argtypes = argtypes
    if hasattr(lib, "sem_clockwait"):  # glibc >= 2.30: a deadline on the monotonic clock
        lib.sem_clockwait.restype = ctypes.c_int
        lib.sem_clockwait.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Timespec)]
    return lib


def available() -> bool:
    """Whether named POSIX semaphores (glibc's sem_open on Linux) can carry the hand-offs here."""
    return _libc() is not None and os.path.isdir(shm.SHM_DIR)


def shm_identity() -> list[int] | None:
    """Which shared-memory filesystem this process sees (device and inode of its directory).

    Two processes can share a named semaphore only if they see the same one; containers that share the
    trainer's socket directory but not its /dev/shm (the cuda_ipc transport needs no /dev/shm otherwise)
    get the frame fallback instead of names they cannot open.
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


def _name_pattern() -> re.Pattern[str]:
    """A session's semaphore names of this uid (read at each call: a process may drop privileges after import)."""
    return re.compile(rf"/{re.escape(shm.segment_prefix())}\d+-[0-9a-f]{{32}}-(packed|consumed)")


def semaphore_file(name: str) -> str:
    """Where glibc keeps the named semaphore ``name`` ("/x" lives in /dev/shm/sem.x)."""
    return os.path.join(shm.SHM_DIR, "sem." + name[1:])


def _error(call: str, name: str) -> TransferError:
    return TransferError(f"{call} of semaphore {name} failed: {os.strerror(ctypes.get_errno())}")


class Doorbell:
    """The two hand-off semaphores of one session, named and laid out by the C library."""

    def __init__(self, names: tuple[str, ...], *, owner: bool) -> None:
        self.names = names
        self._owner = owner
        self._libc = _libc()
        self._sems: list[int] = []  # sem_t * from sem_open, in the order of names
        self._locks: list[int] = []  # the sender's flocked descriptors, held while the names exist
        self._post_streams: dict[int, Any] = {}  # CUDA streams with a post queued: synchronized before closing

    @classmethod
    def create(cls) -> Doorbell:
        """The sender's two semaphores under a fresh random name, each file locked against the stale sweep."""
        libc = _libc()
        if libc is None:
            raise TransferError("no named semaphores: this process's C library lacks sem_open")
        base = f"/{shm.segment_prefix()}{os.getpid()}-{secrets.token_hex(16)}"
        bell = cls(tuple(f"{base}-{suffix}" for suffix in _SUFFIXES), owner=True)
        try:
            for name in bell.names:
                sem = libc.sem_open(name.encode(), _O_CREAT | _O_EXCL, 0o600, 0)
                if not sem:
                    raise _error("sem_open", name)
                bell._sems.append(sem)
                bell._locks.append(_lock(semaphore_file(name)))
        except BaseException:
            bell.close()
            raise
        return bell

    @classmethod
    def open(cls, control: Any) -> Doorbell:
        """The receiver's view of the sender's semaphores, from the ``control`` field of setup; the names are
        unlinked at once (both sides hold the semaphores now: no crash can leak them)."""
        libc = _libc()
        if libc is None:
            raise TransferError("the sender uses named semaphores, which this process's C library lacks")
        pattern = _name_pattern()
        if not (
            type(control) is list
            and len(control) == len(_SUFFIXES)
            and all(type(name) is str and (m := pattern.fullmatch(name)) and m.group(1) == suffix
                    for name, suffix in zip(control, _SUFFIXES, strict=True))
        ):  # fmt: skip
            raise ProtocolError(
                f"setup: control={control!r} is not this uid's two semaphore names "
                f"(/{shm.segment_prefix()}<pid>-<32 hex>-packed, then -consumed)"
            )
        bell = cls(tuple(control), owner=False)
        try:
            for name in bell.names:
                _check_file(semaphore_file(name))  # (an empty file would be a SIGBUS at the first wait)
                sem = libc.sem_open(name.encode(), 0, 0, 0)
                if not sem:
                    raise _error("sem_open", name)
                bell._sems.append(sem)
        except BaseException:
            bell.close()
            raise
        finally:
            bell.unlink()
        return bell

    def control(self) -> list[str]:
        """What the setup's ``control`` field carries: the two names, PACKED's first."""
        return list(self.names)

    # -- posting ----------------------------------------------------------------------------------

    def post(self, which: int) -> None:
        """Announce one more bucket now (the data it stands for is complete)."""
        if self._libc.sem_post(self._sems[which]) != 0:  # type: ignore[union-attr]
            raise _error("sem_post", self.names[which])

    def post_when_done(self, which: int, stream: Any) -> None:
        """Announce once the work queued on ``stream`` ran; at once when ``stream`` is None (CPU work is
        done) or has nothing pending (a query costs microseconds; a host function's run is noticed by
        the driver's callback thread some time later). A stream that is idle has also run every post
        queued on it before, so announcements stay in order."""
        if stream is None or stream.query():
            self.post(which)
        else:
            self.post_after(which, stream)

    def post_after(self, which: int, stream: Any) -> None:
        """Announce one more bucket when ``stream`` (a torch.cuda.Stream) reaches this point."""
        import torch

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
        """Consume one announcement: at once when ``timeout_s`` is 0, else blocking up to ``timeout_s``."""
        libc, sem = self._libc, self._sems[which]
        if timeout_s <= 0.0:
            return libc.sem_trywait(sem) == 0  # type: ignore[union-attr]
        clockwait = getattr(libc, "sem_clockwait", None)
        # The monotonic clock where the C library takes it (a wall-clock step cannot stretch the wait).
        deadline = (time.monotonic() if clockwait is not None else time.time()) + timeout_s
        spec = _Timespec(int(deadline), int((deadline % 1.0) * 1e9))
        while (
            clockwait(sem, time.CLOCK_MONOTONIC, ctypes.byref(spec)) if clockwait is not None
            else libc.sem_timedwait(sem, ctypes.byref(spec))  # type: ignore[union-attr]
        ) != 0:  # fmt: skip
            err = ctypes.get_errno()
            if err == errno.ETIMEDOUT:
                return False
            if err != errno.EINTR:
                raise TransferError(f"waiting on semaphore {self.names[which]} failed: {os.strerror(err)}")
        return True

    # -- lifetime ---------------------------------------------------------------------------------

    def unlink(self) -> None:
        """Drop both names (each side keeps its semaphores), then the sender's locks; idempotent."""
        for name in self.names:
            if self._libc is not None:
                self._libc.sem_unlink(name.encode())  # (ENOENT: the peer or a sweep removed it first)
        locks, self._locks = self._locks, []
        for fd in locks:  # after the names went, so a live owner's name is never unlocked
            os.close(fd)

    def close(self) -> None:
        """Close both semaphores (and, on the sender, drop the names) once every queued post has run.

        A post that could still run would write into a closed mapping: if the streams cannot be
        synchronized, the semaphores are left open (and the error raised) rather than closed.
        """
        if self._owner:
            self.unlink()
        if not self._sems:
            return
        self.synchronize_posts()
        self._post_streams.clear()
        sems, self._sems = self._sems, []
        for sem in sems:
            self._libc.sem_close(sem)  # type: ignore[union-attr]


def _lock(path: str) -> int:
    """A descriptor of the semaphore file ``path`` with an exclusive flock, held while the name exists (the stale
    sweep leaves locked files alone); TransferError if a sweep removed the name before the lock was taken."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise TransferError(f"cannot open the semaphore file {path} that sem_open made: {exc}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not os.path.samestat(os.fstat(fd), os.stat(path)):
            raise FileNotFoundError(path)
    except OSError as exc:  # a sweep held it (BlockingIOError) or removed it (FileNotFoundError)
        os.close(fd)
        raise TransferError(f"the semaphore file {path} was swept as stale before it was locked: {exc}") from exc
    return fd


def _check_file(path: str) -> None:
    """ProtocolError unless ``path`` is a non-empty regular file of this uid (what sem_open makes)."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise TransferError(f"setup: cannot open the semaphore file {path}: {exc}") from exc
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size == 0:
        raise ProtocolError(
            f"setup: {path} is not a semaphore file of uid {os.getuid()} (mode {info.st_mode:o}, uid {info.st_uid}, "
            f"{info.st_size} bytes)"
        )
