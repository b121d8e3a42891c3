"""POSIX shared-memory transport: one segment per session, freed when both sides let go of it.

Where the bytes live (``Segment``):

- **A sealed memfd** when sender and receiver share a PID namespace (the receiver's hello carries
  ``pid_namespace()``; the sender compares it with its own). It is sized (``ftruncate``, pages come
  as they are written), then sealed against shrinking and growing, and the receiver opens it
  through ``/proc/<sender pid>/fd/<n>``. It has no name (no crash can leak it) and is not limited
  by the size of ``/dev/shm`` (only by memory, like any allocation).
- **A named file** ``/dev/shm/refitkit-<uid>-<pid>-<session>`` otherwise (different PID
  namespaces, or ``REFITKIT_NAMED_SEGMENTS=1`` in the receiver's environment, e.g. where the
  sender's ``/proc/<pid>/fd`` cannot be opened). It is made unnamed (``O_TMPFILE``), reserved and
  locked (``flock``), and only then linked under its name, so no half-made file is ever visible and
  a failure leaves nothing behind. The owner keeps the lock while the name exists; the name goes
  as soon as the receiver mapped it (both mappings stay valid).

Reserving a named file up front means a full ``/dev/shm`` (Docker's default is 64 MiB) is a
``TransferError`` naming the size, the free space and the knobs before the first byte, never a
SIGBUS at a write. It also costs a zeroing of the whole bucket every session (~0.5 s/GiB on the
CPU machine): where names are used, give generators a ``bucket_bytes`` near what they send.

A sender that was SIGKILLed before its name went leaves a named file behind: every new sender
sweeps this uid's files whose lock it can take itself (the owner is gone, whatever PID namespace it
ran in); files of other uids, links and anything else are skipped and logged.

What a same-uid peer (the other side, or any process of this uid) can and cannot do:

- it cannot shrink or grow a memfd segment: the seals bind everybody, the creator included, so
  neither side can be killed by SIGBUS through a truncated memfd;
- a named segment can be truncated by whoever opens it while the name exists (from its creation
  to the receiver's mapping, a few milliseconds), and at any time by a peer that kept a descriptor:
  the side touching the lost pages then dies of SIGBUS. That window is why names are the fallback;
- it can always change the bytes (a same-uid process may also write ``/proc/<pid>/mem``): the
  receiver checks every size against the session it announced, but the weights' values are only
  as trustworthy as the peer. Other uids are kept out by file modes
  (0600) and the private socket directory.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import stat
import weakref
from typing import Any

import torch

from refitkit.errors import ProtocolError, TransferError

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAMED_SEGMENTS_ENV = "REFITKIT_NAMED_SEGMENTS"
_NAME = re.compile(r"^refitkit-(\d+)-\d+-[0-9a-f]+$")  # refitkit-<uid>-<pid>-<session>
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_KNOBS = "pass a smaller bucket_bytes, give the container more shared memory (docker --shm-size), or use transport='cuda_ipc'"


def pid_namespace() -> list[int] | None:
    """This process's PID namespace (device, inode), or None where the receiver must get named segments."""
    if os.environ.get(NAMED_SEGMENTS_ENV, "") not in ("", "0") or not hasattr(os, "memfd_create"):
        return None
    try:
        info = os.stat("/proc/self/ns/pid")
    except OSError:
        return None
    return [info.st_dev, info.st_ino]


def segment_prefix() -> str:
    """The name prefix of this uid's segments (read at each call: a process may drop privileges after import)."""
    return f"refitkit-{os.getuid()}-"


def _ours(name: str) -> bool:
    match = _NAME.match(name)
    return match is not None and int(match.group(1)) == os.getuid()


def unlink_quietly(path: str | None) -> None:
    """Remove a name that the peer (or an earlier cleanup) may have removed already; None: no name."""
    if path is None:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def check_segment_path(path: str) -> None:
    """ProtocolError unless ``path`` names one of this uid's segments in the shared-memory directory."""
    if os.path.dirname(path) != SHM_DIR or not _ours(os.path.basename(path)):
        raise ProtocolError(f"shm handle names {path!r}, not a refitkit segment of uid {os.getuid()} in {SHM_DIR}")


# -- the sweep ------------------------------------------------------------------------------------


def remove_stale_segments() -> int:
    """Unlink this uid's named segments whose owner is gone (their lock is free); returns how many."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    removed = 0
    for name in names:
        if _ours(name) and _remove_if_orphaned(os.path.join(SHM_DIR, name)):
            removed += 1
    if removed:
        log.info("removed %d stale shared-memory segment(s) of dead senders", removed)
    return removed


def _remove_if_orphaned(path: str) -> bool:
    try:
        seen = os.lstat(path)
    except FileNotFoundError:
        return False  # another sweep (or its receiver) removed it first
    if not stat.S_ISREG(seen.st_mode) or seen.st_uid != os.getuid():
        log.warning(
            "stale sweep skips %s: not a regular file of uid %d (uid %d, mode %o)",
            path,
            os.getuid(),
            seen.st_uid,
            seen.st_mode,
        )
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("stale sweep skips %s: %s", path, exc)
        return False
    try:
        if not os.path.samestat(os.fstat(fd), seen):
            return False  # replaced between the look and the open: look again next time
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its owner is alive, in this PID namespace or another
        unlink_quietly(path)
        return True
    finally:
        os.close(fd)


# -- segments -------------------------------------------------------------------------------------


class Segment:
    """A shared-memory segment this process made and maps: a sealed memfd, or a locked named file."""

    def __init__(self, nbytes: int, *, name: str, peer_pidns: Any = None) -> None:
        """``name`` ends the segment's name (``<prefix><pid>-<name>``); ``peer_pidns`` is the receiver's
        ``pid_namespace()`` from its hello (a memfd only when it equals ours)."""
        self.nbytes = nbytes
        self.name = f"{segment_prefix()}{os.getpid()}-{name}"
        own = pid_namespace()
        self.memfd = own is not None and peer_pidns == own
        self._pidns = own
        self.path: str | None = None if self.memfd else os.path.join(SHM_DIR, self.name)
        self._fd: int | None = self._make_memfd() if self.memfd else self._make_named()
        try:
            self.mapping = mmap.mmap(self._fd, nbytes)
        except BaseException as exc:
            self.unlink()
            if isinstance(exc, OSError):  # e.g. ENOMEM: more than the address space (or RLIMIT_AS) leaves room for
                raise TransferError(f"cannot map a shared-memory segment of {nbytes} bytes ({exc}): {_KNOBS}") from exc
            raise

    def _make_memfd(self) -> int:
        try:
            fd = os.memfd_create(self.name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise TransferError(f"cannot make a memfd segment of {self.nbytes} bytes ({exc})") from exc
        try:
            # Sized, not reserved: a memfd is not bounded by /dev/shm (no SIGBUS from a full one), and taking
            # every page up front zeroed the whole bucket each session (a 2 GiB generator bucket cost ~1 s to
            # make and ~0.7 s to free on the CPU machine, for a stream that may use a few MiB of it).
            os.ftruncate(fd, self.nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError):  # e.g. EFBIG past the file size limit
                raise TransferError(f"cannot size a memfd segment to {self.nbytes} bytes ({exc}): {_KNOBS}") from exc
            raise
        return fd

    def _make_named(self) -> int:
        free_bytes = _free_bytes(SHM_DIR)
        if free_bytes is not None and self.nbytes > free_bytes:
            raise _no_room(self.nbytes, free_bytes)
        try:
            fd = os.open(SHM_DIR, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise TransferError(f"cannot make a shared-memory segment in {SHM_DIR}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while named: the stale sweep leaves it alone
            _reserve(fd, self.nbytes, where=SHM_DIR)
            _link(fd, self.path)  # type: ignore[arg-type]  # complete, then visible
        except BaseException:
            os.close(fd)  # unnamed until the link: closing frees it
            raise
        return fd

    def handle(self) -> dict[str, Any]:
        """The fields the receiver needs to open this segment (``open_segment``)."""
        if self.memfd:
            return {
                "memfd": {"pid": os.getpid(), "fd": self._fd, "pidns": self._pidns},
                "name": self.name,
                "nbytes": self.nbytes,
            }
        return {"path": self.path, "nbytes": self.nbytes}

    def unlink(self) -> None:
        """The receiver holds its own mapping: drop the name, then the descriptor (and its lock); idempotent."""
        unlink_quietly(self.path)  # before the lock goes, so a live owner's name is never unlocked
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _link(fd: int, path: str) -> None:
    """Give the unnamed file ``fd`` the name ``path`` (linkat through /proc, following the magic link)."""
    proc_fds = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(str(fd), path, src_dir_fd=proc_fds, follow_symlinks=True)
    finally:
        os.close(proc_fds)


def _free_bytes(directory: str) -> int | None:
    try:
        info = os.statvfs(directory)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


def _no_room(nbytes: int, free_bytes: int | None) -> TransferError:
    free = "unknown" if free_bytes is None else f"{free_bytes} bytes ({free_bytes / 2**20:.1f} MiB)"
    return TransferError(
        f"shared-memory bucket of {nbytes} bytes ({nbytes / 2**20:.1f} MiB) does not fit {SHM_DIR} "
        f"(free: {free}): {_KNOBS}"
    )


def _reserve(fd: int, nbytes: int, *, where: str) -> None:
    """Take every page now: running out is this error, not a SIGBUS at the first write."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise _no_room(nbytes, _free_bytes(SHM_DIR) if where == SHM_DIR else None) from exc
        raise TransferError(f"cannot reserve {nbytes} bytes of {where}: {exc}") from exc


def open_segment(handle: Any, *, what: str) -> mmap.mmap:
    """Map the peer's segment from a setup handle (``what`` names it in errors), after checking it is one
    of this uid's refitkit segments of exactly the announced size, and a memfd sealed against shrinking."""
    if not isinstance(handle, dict) or type(handle.get("nbytes")) is not int or handle["nbytes"] <= 0:
        raise ProtocolError(f"setup: bad {what} handle {handle!r}")
    nbytes = handle["nbytes"]
    if "memfd" in handle:
        fd = _open_memfd(handle, what=what)
    else:
        path = handle.get("path")
        if not isinstance(path, str):
            raise ProtocolError(f"setup: bad {what} handle {handle!r}")
        check_segment_path(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise TransferError(f"setup: cannot open the {what} {path}: {exc}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size != nbytes:
            raise ProtocolError(
                f"setup: the {what} is not a regular file of uid {os.getuid()} with {nbytes} bytes "
                f"(uid {info.st_uid}, {info.st_size} bytes)"
            )
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)  # the mapping keeps the memory; the descriptor is not needed


def _open_memfd(handle: dict[str, Any], *, what: str) -> int:
    source, name = handle["memfd"], handle.get("name")
    if (
        not isinstance(source, dict)
        or type(source.get("pid")) is not int
        or type(source.get("fd")) is not int
        or source["pid"] <= 0
        or source["fd"] < 0
        or not isinstance(name, str)
        or not name.startswith(f"{segment_prefix()}{source['pid']}-")
    ):
        raise ProtocolError(f"setup: bad {what} handle {handle!r}")
    if source.get("pidns") != pid_namespace():
        raise ProtocolError(
            f"setup: the {what} is a memfd in another PID namespace; its /proc/<pid>/fd is not ours to open"
        )
    path = f"/proc/{source['pid']}/fd/{source['fd']}"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)  # a /proc magic link: O_NOFOLLOW would refuse it
    except OSError as exc:
        raise TransferError(
            f"setup: cannot open the {what} through {path} ({exc}); where the sender's /proc/<pid>/fd is closed "
            f"to the receiver (a non-dumpable or confined sender), set {NAMED_SEGMENTS_ENV}=1 in the receiver's "
            "environment for named segments in /dev/shm"
        ) from exc
    try:
        target, seals = os.readlink(f"/proc/self/fd/{fd}"), fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        target, seals = "", 0  # F_GET_SEALS fails on anything but a memfd or tmpfs file
    if target != f"/memfd:{name} (deleted)" or not seals & fcntl.F_SEAL_SHRINK:
        os.close(fd)
        raise ProtocolError(f"setup: {path} is {target or 'not a file'}, not the sealed memfd {name!r} ({what})")
    return fd


class _Mapped:
    """An mmap seen as a uint8 CPU tensor; closing fails loudly while any view is still alive."""

    def __init__(self, mapping: mmap.mmap) -> None:
        self._mmap: mmap.mmap | None = mapping
        # Through a memoryview, so the mmap refuses to close while a tensor view exists (no dangling views).
        self.tensor: torch.Tensor | None = torch.frombuffer(memoryview(mapping), dtype=torch.uint8)

    def close(self, *, what: str) -> None:
        self.tensor = None
        mapping, self._mmap = self._mmap, None
        if mapping is None:
            return
        try:
            mapping.close()
        except BufferError as exc:
            # The mapping is unmapped when the last view dies; say who kept it.
            raise TransferError(
                f"{what}: a tensor view of the shared-memory bucket is still referenced "
                "(tensors handed to on_bucket / iter_weights are valid only until the next one; copy them)"
            ) from exc


class ShmBucket(_Mapped):
    """The sender's bucket buffer in a fresh shared-memory segment."""

    transport = "shm"

    def __init__(self, nbytes: int, *, session: str, peer_pidns: Any = None) -> None:
        """``peer_pidns``: the receiver's ``pid_namespace()`` from its hello (see ``Segment``)."""
        self._segment = Segment(nbytes, name=session, peer_pidns=peer_pidns)
        try:
            super().__init__(self._segment.mapping)
        except BaseException:
            self._segment.unlink()
            self._segment.mapping.close()
            raise
        self.path = self._segment.path
        self.nbytes = nbytes

    def handle(self) -> dict[str, Any]:
        """The fields the receiver needs to map this bucket."""
        return self._segment.handle()

    def receiver_mapped(self) -> None:
        """The receiver holds its own mapping: drop the name (or descriptor) so no crash can leak the segment."""
        self._segment.unlink()

    def shipped(self) -> None:
        """Packing copies into host memory are synchronous: a shipped bucket's bytes are complete (no stream)."""
        return None

    def free(self) -> None:
        """Unmap and unlink; idempotent."""
        self._segment.unlink()
        self.close(what="sender bucket")


class _DeviceStaging:
    """A device buffer lent out only through views that keep this holder alive.

    A GPU receiver on shm copies each bucket here; the views it hands to the loader point into this
    buffer, not into the mapping, so the mapping alone cannot tell whether a loader kept one. A view
    kept past its bucket would silently change with the next bucket and keep the buffer allocated
    after the session, so release checks the holder is gone, as it checks the mapping.
    """

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self._owner = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (self._owner.data_ptr(), False),
            "version": 3,
            "strides": None,
        }


def _lend(nbytes: int, device: torch.device) -> tuple[torch.Tensor, weakref.finalize]:
    holder = _DeviceStaging(nbytes, device)
    tensor = torch.as_tensor(holder, device=device)  # the tensor's storage holds ``holder`` (and so the memory)
    return tensor, weakref.finalize(holder, lambda: None)


_KEPT_STAGING = (
    "receiver release: a tensor view of the device staging buffer is still referenced "
    "(tensors handed to on_bucket / iter_weights are valid only until the next one; copy them)"
)


class ShmMapping(_Mapped):
    """The receiver's mapping of the sender's segment, mapped once per session."""

    def __init__(self, handle: dict[str, Any], device: torch.device) -> None:
        super().__init__(open_segment(handle, what="shm bucket"))
        self.device = device
        self._staging: torch.Tensor | None = None
        self._staging_lent: weakref.finalize | None = None

    def bucket(self, offset: int, used_bytes: int) -> torch.Tensor:
        """The used bytes of one bucket as a uint8 tensor on the receiver's device."""
        if self.tensor is None:
            raise TransferError("receiver: a bucket was asked for after the shm mapping was released")
        view = self.tensor[offset : offset + used_bytes]
        if self.device.type == "cpu":
            return view
        # A GPU receiver on shm: one host-to-device copy per bucket into a staging buffer kept for the session,
        # sized for the whole mapping at once: a wide bucket must not regrow it while a caller (a for-loop
        # over iter_weights) still holds the previous bucket's last tensor.
        if self._staging is None:
            self._staging, self._staging_lent = _lend(self.tensor.numel(), self.device)
        staged = self._staging[:used_bytes]
        staged.copy_(view)
        return staged

    def release(self) -> None:
        """Drop the staging buffer and unmap; raises TransferError if a view of either is still referenced."""
        try:
            self._drop_staging()
        finally:
            self.close(what="receiver release")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the staging buffer goes back to the device, not to torch's cache

    def _drop_staging(self) -> None:
        self._staging = None
        lent, self._staging_lent = self._staging_lent, None
        if lent is not None and lent.alive:
            raise TransferError(_KEPT_STAGING)
