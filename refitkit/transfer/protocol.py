"""Wire format of a transfer session: versioned msgpack frames, no pickle, metadata as plain data.

Every frame is one ZMQ message holding a msgpack map ``{"v": WIRE_VERSION, "kind": ..., ...}``.
Kinds and their fields (R = receiver, S = sender):

- ``hello``    R→S  ``pid``, ``device`` ("cpu" or "cuda"), ``device_uuid`` (CUDA only)
- ``setup``    S→R  ``session``, ``transport`` ("shm", "cuda_ipc" or "none"), ``half_bytes``,
                    ``handle`` (the transport's raw fields: shm path, or CUDA IPC handle bytes)
- ``ready``    R→S  ``session``: the bucket buffer is mapped (once for the whole session)
- ``bucket``   S→R  ``session``, ``seq``, ``half``, ``last``, ``entries`` (see ``Entry``)
- ``done``     R→S  ``session``, ``seq``: bucket ``seq`` consumed, its half may be reused
- ``released`` R→S  ``session``, ``seq``: final ACK, sent only after every view and the
                    mapping were released
- ``error``    R→S  ``session``, ``phase``, ``message``: the receiver failed (it already released)
- ``abort``    S→R  ``session``, ``reason``: the sender gave up; the receiver releases and
                    answers ``released``
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import zmq

from refitkit.errors import ProtocolError, TransferTimeout
from refitkit.transfer.phases import SessionPhase

WIRE_VERSION = 1
KINDS = frozenset({"hello", "setup", "ready", "bucket", "done", "released", "error", "abort"})
# Entries start on this boundary so every dtype view of the bucket is aligned (and GPU copies coalesce).
ALIGN_BYTES = 256
# A frame is metadata only; anything bigger is not ours.
MAX_FRAME_BYTES = 64 << 20

SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz,
        torch.float8_e8m0fnu,
        torch.complex128, torch.complex64, torch.complex32,
        torch.int64, torch.int32, torch.int16, torch.int8,
        torch.uint64, torch.uint32, torch.uint16, torch.uint8,
        torch.bool,
    )
}  # fmt: skip


def dtype_name(dtype: torch.dtype) -> str | None:
    """The wire name of a supported dtype, or None when the dtype cannot be shipped."""
    name = str(dtype).removeprefix("torch.")
    return name if SUPPORTED_DTYPES.get(name) is dtype else None


def align_up(offset: int) -> int:
    """Round an offset up to ``ALIGN_BYTES``."""
    return (offset + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


@dataclass(frozen=True)
class Entry:
    """One tensor, or one byte range of a tensor split across buckets, inside a bucket half."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # byte offset inside the half
    nbytes: int  # bytes of this piece
    start: int  # first byte of the tensor this piece carries (0 unless split)
    total: int  # bytes of the whole tensor

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.nbytes == self.total

    @property
    def completes(self) -> bool:
        return self.start + self.nbytes == self.total

    def to_wire(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes, self.start, self.total]

    @classmethod
    def from_wire(cls, raw: Any) -> "Entry":
        try:
            name, dtype, shape, offset, nbytes, start, total = raw
            entry = cls(str(name), str(dtype), tuple(int(s) for s in shape), int(offset), int(nbytes),
                        int(start), int(total))  # fmt: skip
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed bucket entry {raw!r}: {exc}") from None
        if entry.dtype not in SUPPORTED_DTYPES or min(entry.offset, entry.nbytes, entry.start) < 0:
            raise ProtocolError(f"bucket entry for {entry.name!r} has bad dtype or byte range: {raw!r}")
        return entry


def encode(kind: str, **fields: Any) -> bytes:
    """One frame of ``kind`` with ``fields``."""
    assert kind in KINDS, kind
    return msgpack.packb({"v": WIRE_VERSION, "kind": kind, **fields}, use_bin_type=True)


def decode(raw: bytes) -> dict[str, Any]:
    """Parse one frame; anything that is not a refitkit frame of this version is a ProtocolError."""
    if len(raw) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(raw)} bytes is larger than any refitkit frame")
    try:
        frame = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"undecodable frame ({type(exc).__name__}: {exc}); first bytes {raw[:16]!r}") from None
    if not isinstance(frame, dict):
        raise ProtocolError(f"frame is a msgpack {type(frame).__name__}, not a map; first bytes {raw[:16]!r}")
    if frame.get("v") != WIRE_VERSION:
        raise ProtocolError(f"wire version {frame.get('v')!r}, expected {WIRE_VERSION}")
    if frame.get("kind") not in KINDS:
        raise ProtocolError(f"unknown frame kind {frame.get('kind')!r}")
    return frame


def expect(frame: dict[str, Any], *kinds: str, session: str | None = None) -> dict[str, Any]:
    """Check a decoded frame is one of ``kinds`` (and of ``session``), else ProtocolError."""
    if frame["kind"] not in kinds:
        raise ProtocolError(f"expected a {'/'.join(kinds)} frame, got {frame['kind']!r}")
    if session is not None and frame.get("session") != session:
        raise ProtocolError(f"frame for session {frame.get('session')!r}, expected {session!r}")
    return frame


def recv_frame(
    sock: zmq.Socket,
    *,
    timeout_s: float,
    phase: SessionPhase,
    waiting_for: str,
    peer: str,
) -> list[bytes]:
    """Receive one multipart message within ``timeout_s``, else TransferTimeout naming phase and knob."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
        if sock.poll(remaining_ms, zmq.POLLIN):
            return sock.recv_multipart(copy=True)
        if time.monotonic() >= deadline:
            raise TransferTimeout(
                f"{phase.value}: no {waiting_for} from {peer} within timeout_s={timeout_s:g} "
                f"(peer dead or stuck? raise timeout_s if it is just slow)"
            )
