"""Wire format of a transfer session: versioned msgpack frames, no pickle, metadata as plain data.

Every frame is one ZMQ message holding a msgpack map ``{"v": WIRE_VERSION, "kind": ..., ...}``.
Kinds and their fields (R = receiver, S = sender):

- ``hello``    R→S  ``pid``, ``device`` ("cpu" or "cuda"), ``device_uuid`` (CUDA only),
                    ``timeout_s`` (how long a hello queued during another session stays worth serving),
                    ``pidns`` (the receiver's PID namespace, see ``shm.pid_namespace``; None: named segments),
                    ``exchange`` (a token of this sync: a receiver channel says hello once per sync on its one
                    connection, and takes only the setup or abort that echoes it)
- ``setup``    S→R  ``session``, ``exchange`` (the hello's), ``transport`` ("shm", "cuda_ipc" or "none"), ``half_bytes``,
                    ``handle`` (the transport's raw fields: a segment handle, see ``shm.Segment.handle``
                    — ``{"path", "nbytes"}`` for a named segment or ``{"memfd": {"pid", "fd", "pidns"},
                    "name", "nbytes"}`` for a sealed memfd — or the CUDA IPC handle bytes); ``pid`` and
                    ``pidns`` (optional: the sender's process, which the receiver follows by a pidfd)
- ``ready``    R→S  ``session``: the bucket buffer is mapped (once for the whole session); the
                    sender does not wait for it before packing and queueing buckets
- ``bucket``   S→R  ``session``, ``seq``, ``half``, ``wide``, ``last``, ``entries``: sent as soon as
                    the bucket's copies are issued; its bytes may be read once the bucket is
                    announced as packed (its ``packed`` frame).
                    A bucket is one half of the buffer, or (``wide``, with ``half`` 0) the whole
                    buffer, used for a tensor larger than a half so that it arrives as one view.
                    Each entry is ``[name, dtype, shape, offset]`` for a whole tensor, or
                    ``[name, dtype, shape, offset, start, nbytes]`` for a byte range of a tensor
                    split across buckets; offsets are relative to the bucket and ``ALIGN_BYTES``-aligned
- ``packed``   S→R  ``session``, ``seq``: bucket ``seq``'s bytes are complete (at most ``MAX_IN_FLIGHT``
                    buckets ahead of the one being read)
- ``done``     R→S  ``session``, ``seq``: bucket ``seq`` consumed, its half (or both) may be reused
- ``released`` R→S  ``session``, ``seq``: final ACK, sent only after every view and the
                    mapping were released
- ``error``    R→S  ``session``, ``phase``, ``message``: the receiver failed (it already released); with the
                    exception that made it fail, also ``error_type``, ``error_message`` and ``traceback`` (its last
                    frames as text, ``failure_fields``), which the sender raises as a ``RemoteError`` cause, and
                    for a refitkit error that crosses as its type, ``error_code`` and ``error_fields``
                    (``errors.error_record``: the cause's ``error``)
- ``abort``    S→R  ``session``, ``reason``, ``exchange`` (the hello's): the sender gave up, or refused the
                    hello (``session`` empty); the receiver releases and answers ``released``
"""

from __future__ import annotations

import os
import reprlib
import traceback
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack
import torch

from refitkit.errors import ProtocolError, RemoteError, TransferTimeout, error_from_record, error_record
from refitkit.offload.device import ALIGN_BYTES, align_up  # noqa: F401 (re-exported: the wire's alignment)
from refitkit.transfer.common import SessionPhase

# 2: short entries for whole tensors, wide buckets; 3: early bucket frames, progress counters;
# 4: segment handles (sealed memfds or named), hello's pidns; 5: direct buckets (the sender's own allocations);
# 6: a direct session's bucket announced with the first bucket that uses it (bucket_later), up to 4 buckets in flight;
# 7: receiver channels (hello's exchange token, echoed by setup and abort); setup's control names two semaphores
# made by the C library (no counter segment); 8: hand-offs as packed / done frames only (no control, no hello shm),
# no allocations exported with the setup
WIRE_VERSION = 8
KINDS = frozenset({"hello", "setup", "ready", "bucket", "packed", "done", "released", "error", "abort"})
# A frame is metadata only; anything bigger is not ours (sockets refuse it too: zmq.MAXMSGSIZE).
MAX_FRAME_BYTES = 64 << 20
# More dimensions than torch itself handles well is not a weight; bounds the work of checking a shape.
MAX_DIMS = 64
# The largest tensor byte count that still fits the int64 element arithmetic of views and copies.
MAX_TENSOR_BYTES = (1 << 63) - 1
# Direct buckets: at most this many of the sender's allocations mapped in one session, and entries in one frame.
MAX_EXPORTS = 1024
DIRECT_MAX_TENSORS = 512
# Buckets a sender may have in flight at once (shipped, not yet announced done): the bucket's two halves, and beside
# them this many direct buckets (they occupy no half). A receiver refuses announcements further ahead than that.
DIRECT_IN_FLIGHT = 2
MAX_IN_FLIGHT = 2 + DIRECT_IN_FLIGHT

_brief_repr = reprlib.Repr()
_brief_repr.maxlevel, _brief_repr.maxlist, _brief_repr.maxstring, _brief_repr.maxother = 3, 8, 80, 80


def brief(value: Any) -> str:
    """A short repr of something that came off the wire (it may be huge or deeply nested)."""
    return _brief_repr.repr(value)


# A failure report carries the last frames of the failing side's traceback (the loader's own, typically), and at most
# this many characters of it and of the exception's message: enough to find the line, small enough to print.
FAILURE_FRAMES = 8
MAX_FAILURE_CHARS = 8000


def failure_fields(exc: BaseException) -> dict[str, Any]:
    """What a failure report says about the exception behind it, as plain data: its type's name, its message and
    the last ``FAILURE_FRAMES`` frames of its traceback as text (its end, when longer than ``MAX_FAILURE_CHARS``),
    and for a refitkit error that crosses as its type, its code and fields (``errors.error_record``)."""
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    lines = traceback.format_exception(kind, exc, exc.__traceback__, limit=-FAILURE_FRAMES)
    return {
        "error_type": name,
        "error_message": str(exc)[:MAX_FAILURE_CHARS],
        "traceback": "".join(lines)[-MAX_FAILURE_CHARS:],
        **error_record(exc),
    }


def remote_failure(fields: dict[str, Any]) -> RemoteError | None:
    """The peer's exception as a report's ``failure_fields`` described it (None when it named none); a field that
    is not text arrives as its brief repr, and none is longer than ``MAX_FAILURE_CHARS``. A refitkit error that
    crosses as its type comes back rebuilt from its code and fields, as the ``RemoteError``'s ``error``."""
    if fields.get("error_type") is None:
        return None

    def text(key: str) -> str | None:
        value = fields.get(key)
        if value is None:
            return None
        return (value if type(value) is str else brief(value))[-MAX_FAILURE_CHARS:]

    message = text("error_message") or ""
    error = error_from_record(fields.get("error_code"), message, fields.get("error_fields"))
    return RemoteError(text("error_type") or "?", message, text("traceback"), error=error)


SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2,
        torch.float8_e5m2fnuz,
        torch.float8_e8m0fnu,
        torch.complex128,
        torch.complex64,
        torch.complex32,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint64,
        torch.uint32,
        torch.uint16,
        torch.uint8,
        torch.bool,
    )
}


WIRE_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in SUPPORTED_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str | None:
    """The wire name of a supported dtype, or None when the dtype cannot be shipped."""
    return WIRE_DTYPE_NAMES.get(dtype)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major element strides of ``shape``: how every entry lies in the bucket. (Once per tensor on the bucket
    path's unpack: a weight's one or two dims take the short way.)"""
    dims = len(shape)
    if dims == 2:
        return (shape[1] or 1, 1)
    if dims == 1:
        return (1,)
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class Entry(NamedTuple):
    """One tensor, or one byte range of a tensor split across buckets, inside a bucket."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # byte offset inside the bucket (a half, or the whole buffer for a wide bucket)
    nbytes: int  # bytes of this piece
    start: int  # first byte of the tensor this piece carries (0 unless split)
    total: int  # bytes of the whole tensor

    @property
    def whole(self) -> bool:
        return self.nbytes == self.total

    @property
    def completes(self) -> bool:
        return self.start + self.nbytes == self.total


def entry_to_wire(
    name: str, dtype: str, shape: Sequence[int], offset: int, piece: tuple[int, int] | None = None
) -> list[Any]:
    """The wire form of one entry: [name, dtype, shape, offset] for a whole tensor, plus the piece's
    (start, nbytes) for a byte range of a split one."""
    if piece is None:
        return [name, dtype, shape, offset]
    return [name, dtype, shape, offset, piece[0], piece[1]]


def entries_from_wire(raw: Any, *, capacity: int) -> list[Entry]:
    """Parse and check a bucket's entries against a bucket of ``capacity`` bytes; ProtocolError if malformed.

    Every number is checked before it is used: names are non-empty str, dims non-negative ints (at most
    ``MAX_DIMS`` of them, their byte count within int64), offsets aligned, and every byte range inside
    both the bucket and its tensor. This runs once per tensor on the receiver's critical path, so it is
    one flat loop of cheap checks rather than a validating object per entry.
    """
    if type(raw) is not list:
        raise ProtocolError(f"bucket entries are a {type(raw).__name__}, not a list")
    entries: list[Entry] = []
    for item in raw:
        if type(item) is not list or len(item) not in (4, 6):
            raise ProtocolError(f"malformed bucket entry {brief(item)}: not a list of 4 or 6 fields")
        name, dtype_wire, shape, offset = item[:4]
        dtype = SUPPORTED_DTYPES.get(dtype_wire) if type(dtype_wire) is str else None
        if dtype is None or type(shape) is not list or len(shape) > MAX_DIMS:
            raise ProtocolError(
                f"malformed bucket entry {brief(item)}: unknown dtype or shape not a list of <= {MAX_DIMS} dims"
            )
        total = dtype.itemsize
        span = 1  # the largest stride of its views (empty dims count as 1): it too must fit torch's int64
        for size in shape:
            if type(size) is not int or size < 0:
                raise ProtocolError(
                    f"bucket entry {brief(item)} has a bad name, shape or byte range: dim {brief(size)}"
                )
            total *= size
            span *= max(size, 1)
        if (
            total > MAX_TENSOR_BYTES or span > MAX_TENSOR_BYTES
        ):  # Python ints do not overflow; torch's int64 sizes would
            raise ProtocolError(
                f"bucket entry {brief(item)} has a bad name, shape or byte range: its size overflows int64"
            )
        start, nbytes = (0, total) if len(item) == 4 else item[4:]
        if not (
            type(name) is str
            and name
            and type(offset) is int
            and type(start) is int
            and type(nbytes) is int
            and 0 <= offset
            and offset % ALIGN_BYTES == 0
            and offset + nbytes <= capacity
            and 0 <= start
            and 0 <= nbytes
            and start + nbytes <= total
            and (len(item) == 4 or 0 < nbytes < total)  # a piece is a proper, non-empty part of its tensor
        ):
            raise ProtocolError(
                f"bucket entry {brief(item)} has a bad name, shape or byte range (bucket of {capacity} bytes)"
            )
        entries.append(Entry(name, dtype, tuple(shape), offset, nbytes, start, total))
    return entries


class SplitProgress(NamedTuple):
    """How far a tensor split across buckets has arrived (the sender splits one tensor at a time)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    done: int  # bytes arrived so far


def check_split_pieces(entries: list[Entry], progress: SplitProgress | None, *, last: bool) -> SplitProgress | None:
    """Where the split tensor in flight stands after this bucket's entries; ProtocolError unless its pieces
    arrive in order, one tensor at a time, each with the dtype and shape its first piece announced, and
    the tensor is complete by the last bucket."""
    for entry in entries:
        if entry.whole:
            continue
        if entry.start == 0 and progress is not None:
            raise ProtocolError(f"{entry.name!r}: a split tensor starts while {progress.name!r} is incomplete")
        if entry.start != 0 and (
            progress is None or (entry.name, entry.dtype, entry.shape, entry.start) != progress[:4]
        ):
            raise ProtocolError(
                f"{entry.name!r}: byte range from {entry.start} ({entry.dtype}, {entry.shape}) arrived out of order "
                f"or does not match its first piece ({progress})"
            )
        done = entry.start + entry.nbytes
        progress = None if done == entry.total else SplitProgress(entry.name, entry.dtype, entry.shape, done)
    if last and progress is not None:
        raise ProtocolError(f"last bucket arrived with {progress.name!r} incomplete ({progress.done} bytes)")
    return progress


def setup_fields(frame: dict[str, Any]) -> tuple[str, str, int, dict[str, Any], bool]:
    """The checked fields of a setup frame: session, transport, half_bytes, handle, bucket_later (a
    cuda_ipc session with no handle yet: the bucket comes with the first bucket frame that uses it)."""
    session, transport, half_bytes = frame.get("session"), frame.get("transport"), frame.get("half_bytes", 0)
    handle, later = frame.get("handle") or {}, frame.get("bucket_later", False)
    if not (
        type(session) is str and session and type(transport) is str and type(half_bytes) is int and type(handle) is dict
    ):
        raise ProtocolError(
            f"setup: session={brief(session)} transport={brief(transport)} half_bytes={brief(half_bytes)} "
            f"handle={brief(handle)} are not a str, str, int and map"
        )
    if type(later) is not bool or (later and (transport != "cuda_ipc" or handle)):
        raise ProtocolError(
            f"setup: bucket_later={brief(later)} is only for a cuda_ipc session that sends no handle yet"
        )
    return session, transport, half_bytes, handle, later


def bucket_fields(frame: dict[str, Any], seq: int) -> tuple[int, bool, bool]:
    """The checked half, wide and last of a bucket frame that must carry sequence number ``seq``."""
    got, half, wide, last = frame.get("seq"), frame.get("half"), frame.get("wide", False), frame.get("last")
    if not (
        type(got) is int
        and got == seq
        and type(half) is int
        and half in (0, 1)
        and type(wide) is bool
        and type(last) is bool
        and not (wide and half)
    ):
        raise ProtocolError(
            f"bucket frame seq={brief(got)} half={brief(half)} wide={brief(wide)} last={brief(last)}, "
            f"expected seq {seq} in half 0 or 1 (wide buckets in half 0)"
        )
    return half, wide, last


def direct_fields(direct: Any, *, entries: list[Entry], sizes: list[int]) -> tuple[list[dict[str, Any]], list[int]]:
    """The checked parts of a direct bucket: the allocations it exports first (raw handle fields, each checked
    when mapped) and, per entry, the allocation it lies in. ``sizes``: the byte sizes of the allocations mapped
    before this bucket. Every entry must be a whole tensor inside its allocation (its size as announced; the
    mapping checks the announcement against the driver's)."""
    exports, allocs, announced = direct_header(direct, count=len(entries), sizes=sizes)
    return exports, direct_allocs(entries, allocs, announced)


def direct_allocs(entries: list[Entry], allocs: list[Any], announced: list[int]) -> list[int]:
    """A direct bucket's ``allocs`` (as ``direct_header`` returned them), checked entry by entry: each a whole
    tensor inside the allocation it names, of the ``announced`` sizes."""
    for entry, index in zip(entries, allocs):
        if type(index) is not int or not 0 <= index < len(announced):
            raise ProtocolError(
                f"direct bucket: {entry.name!r} lies in allocation {brief(index)}; {len(announced)} are exported"
            )
        if not entry.whole or entry.offset + entry.nbytes > announced[index]:
            raise ProtocolError(
                f"direct bucket: {entry.name!r} (bytes {entry.offset}..{entry.offset + entry.nbytes}) is not a whole "
                f"tensor inside allocation {index} of {announced[index]} bytes"
            )
    return allocs


def direct_header(direct: Any, *, count: int, sizes: list[int]) -> tuple[list[dict[str, Any]], list[Any], list[int]]:
    """A direct bucket's fields checked as a whole (``direct_fields`` also checks each entry against them): the
    allocations it exports first, its ``allocs`` list as it came (one per entry of its ``count``), and the sizes of
    every allocation announced up to it (``sizes``, then its exports')."""
    if type(direct) is not dict:
        raise ProtocolError(f"direct bucket: {brief(direct)} is not a map")
    exports, allocs = direct.get("exports"), direct.get("allocs")
    if type(direct.get("kept", False)) is not bool:
        raise ProtocolError(f"direct bucket: kept={brief(direct.get('kept'))} is not a bool")
    if (
        type(exports) is not list
        or type(allocs) is not list
        or len(allocs) != count
        or not 0 < count <= DIRECT_MAX_TENSORS
    ):
        raise ProtocolError(
            f"direct bucket: exports={brief(exports)} allocs={brief(allocs)} are not two lists with one allocation per "
            f"entry ({count} entries, 1 to {DIRECT_MAX_TENSORS})"
        )
    return exports, allocs, _announced(exports, sizes, "direct bucket")


def _announced(exports: list[Any], sizes: list[int], what: str) -> list[int]:
    """``sizes`` followed by the size each of ``exports`` announces (checked: a positive int, MAX_EXPORTS at most)."""
    if len(sizes) + len(exports) > MAX_EXPORTS:
        raise ProtocolError(
            f"{what}: {len(sizes) + len(exports)} exported allocations in one session, at most {MAX_EXPORTS}"
        )
    announced = list(sizes)
    for handle in exports:
        nbytes = handle.get("nbytes") if type(handle) is dict else None
        if type(nbytes) is not int or nbytes <= 0:
            raise ProtocolError(f"{what}: export {brief(handle)} announces no size")
        announced.append(nbytes)
    return announced


def encode(kind: str, **fields: Any) -> bytes:
    """One frame of ``kind`` with ``fields``."""
    if kind not in KINDS:
        raise ProtocolError(f"refusing to encode a frame of unknown kind {kind!r}")
    return msgpack.packb({"v": WIRE_VERSION, "kind": kind, **fields}, use_bin_type=True)


def decode(raw: bytes) -> dict[str, Any]:
    """Parse one frame; anything that is not a refitkit frame of this version is a ProtocolError."""
    if len(raw) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(raw)} bytes is larger than any refitkit frame")
    try:
        frame = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(
            f"undecodable frame ({type(exc).__name__}: {brief(str(exc))}); first bytes {raw[:16]!r}"
        ) from exc
    if not isinstance(frame, dict):
        raise ProtocolError(f"frame is a msgpack {type(frame).__name__}, not a map; first bytes {raw[:16]!r}")
    if frame.get("v") != WIRE_VERSION:
        raise ProtocolError(f"wire version {brief(frame.get('v'))}, expected {WIRE_VERSION}")
    kind = frame.get("kind")
    if type(kind) is not str or kind not in KINDS:
        raise ProtocolError(f"unknown frame kind {brief(kind)}")
    return frame


def expect(frame: dict[str, Any], *kinds: str, session: str | None = None) -> dict[str, Any]:
    """Check a decoded frame is one of ``kinds`` (and of ``session``), else ProtocolError."""
    if frame["kind"] not in kinds:
        raise ProtocolError(f"expected a {'/'.join(kinds)} frame, got {frame['kind']!r}")
    if session is not None and frame.get("session") != session:
        raise ProtocolError(f"frame for session {brief(frame.get('session'))}, expected {session!r}")
    return frame


def timeout_error(phase: SessionPhase, waiting_for: str, peer: str, timeout_s: float) -> TransferTimeout:
    """The one wording of a timed-out wait: the phase, what was awaited from whom, and the knob."""
    return TransferTimeout(
        f"{phase.value}: no {waiting_for} from {peer} within timeout_s={timeout_s:g} "
        f"(peer dead or stuck? raise timeout_s if it is just slow)"
    )


def check_split_fits(entry: Entry, device: torch.device) -> None:
    """ProtocolError unless a split tensor's announced total could be reassembled on ``device`` at all
    (checked at its first piece, before anything is allocated for it)."""
    limit = _device_memory_bytes(device)
    if entry.total > limit:
        raise ProtocolError(
            f"{entry.name!r}: split tensor of {entry.total} bytes {entry.shape} is larger than the "
            f"{limit} bytes of memory of {device}; refusing to allocate it"
        )


def _device_memory_bytes(device: torch.device) -> int:
    """All the memory of ``device``: no tensor from the wire larger than this can be reassembled there."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
