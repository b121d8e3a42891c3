"""POSIX shared-memory transport: one segment per session, unlinked as soon as the receiver mapped it.

Segments live in ``/dev/shm`` as ``refitkit-<uid>-<pid>-<session>`` with mode 0600. The sender
unlinks the name right after the receiver's ``ready`` (both mappings stay valid; nothing can
outlive both processes), and again on any failure. A sender that was SIGKILLed before that point
leaves a named segment behind: the next sender in any process removes segments whose pid is dead.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import weakref
from typing import Any

import torch

from refitkit.errors import ProtocolError, TransferError

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_PREFIX = f"refitkit-{os.getuid()}-"
_SEGMENT = re.compile(rf"^{re.escape(_PREFIX)}(\d+)-[0-9a-f]+$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_segments() -> int:
    """Unlink this user's segments whose creating process is gone; returns how many."""
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return 0
    for name in names:
        match = _SEGMENT.match(name)
        if match and not _pid_alive(int(match.group(1))):
            unlink_quietly(os.path.join(SHM_DIR, name))  # another sender may have cleaned it first
            removed += 1
    if removed:
        log.info("removed %d stale shared-memory segment(s) of dead senders", removed)
    return removed


def unlink_quietly(path: str) -> None:
    """Remove a file that the peer (or an earlier cleanup) may have removed already."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def segment_prefix() -> str:
    """The name prefix of this user's segments: ``<prefix><pid>-<hex>`` is what stale cleanup recognises."""
    return _PREFIX


def check_segment_path(path: str) -> None:
    """ProtocolError unless ``path`` names a refitkit segment in the shared-memory directory."""
    if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith("refitkit-"):
        raise ProtocolError(f"shm handle names {path!r}, not a refitkit segment in {SHM_DIR}")


def map_segment(path: str, nbytes: int, *, create: bool, reserve: bool = False) -> mmap.mmap:
    """Map a segment of ``nbytes`` (made with mode 0600 when ``create``; its size is checked otherwise).

    ``reserve`` takes the pages now (``posix_fallocate``), so a full /dev/shm is an OSError here
    rather than a SIGBUS at the first write.
    """
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create and reserve:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError:
                os.unlink(path)
                raise
        elif create:
            os.ftruncate(fd, nbytes)
        elif os.fstat(fd).st_size != nbytes:
            raise ProtocolError(f"shm segment {path} has {os.fstat(fd).st_size} bytes, setup said {nbytes}")
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)  # the mapping keeps the memory; the descriptor is not needed


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
        except BufferError:
            # The mapping is unmapped when the last view dies; say who kept it.
            raise TransferError(
                f"{what}: a tensor view of the shared-memory bucket is still referenced "
                "(tensors handed to on_bucket / iter_weights are valid only until the next one; copy them)"
            ) from None


class ShmBucket(_Mapped):
    """The sender's bucket buffer in a fresh shared-memory segment."""

    transport = "shm"

    def __init__(self, nbytes: int, *, session: str) -> None:
        self.path = os.path.join(SHM_DIR, f"{_PREFIX}{os.getpid()}-{session}")
        super().__init__(map_segment(self.path, nbytes, create=True))
        self.nbytes = nbytes

    def handle(self) -> dict[str, Any]:
        """The fields the receiver needs to map this bucket."""
        return {"path": self.path, "nbytes": self.nbytes}

    def receiver_mapped(self) -> None:
        """The receiver holds its own mapping: drop the name so no crash can leak the segment."""
        unlink_quietly(self.path)

    def shipped(self) -> None:
        """Packing copies into host memory are synchronous: a shipped bucket's bytes are complete (no stream)."""
        return None

    def free(self) -> None:
        """Unmap and unlink; idempotent."""
        unlink_quietly(self.path)
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
            "shape": (nbytes,), "typestr": "|u1", "data": (self._owner.data_ptr(), False), "version": 3, "strides": None,
        }  # fmt: skip


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
        try:
            path, nbytes = str(handle["path"]), int(handle["nbytes"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(f"bad shm handle {handle!r}") from None
        check_segment_path(path)
        super().__init__(map_segment(path, nbytes, create=False))
        self.device = device
        self._staging: torch.Tensor | None = None
        self._staging_lent: weakref.finalize | None = None

    def bucket(self, offset: int, used_bytes: int) -> torch.Tensor:
        """The used bytes of one bucket as a uint8 tensor on the receiver's device."""
        assert self.tensor is not None
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
