"""The phases of one transfer session, the sender's session states, the shared knob checks, and the
figures a session reports."""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass

import torch

from refitkit._knobs import MAX_TIMEOUT_S, checked_seconds  # noqa: F401  (MAX_TIMEOUT_S: re-exported)
from refitkit.errors import InvalidInput, TransferError
from refitkit.report import gbps

TRANSPORTS = ("auto", "cuda_ipc", "shm")
# The longest timeout_s any wait can hold: ZMQ polls take a C int of milliseconds (2**31 ms is 24.8
# days), and a deadline must stay finite. One week is far beyond any real sync.


class SessionPhase(enum.Enum):
    """Where a transfer session stands; named in every timeout and error message."""

    HANDSHAKE = "handshake"  # hello / setup / ready: the receiver maps the bucket buffer
    STREAMING = "streaming"  # buckets flow; the sender packs i+1 while the receiver consumes i
    DRAINING = "draining"  # last bucket sent; waiting for the receiver to release and ACK
    RELEASED = "released"  # bucket memory freed on both sides (success or failure)


class SendState(enum.Enum):
    """Where one ``send()`` session stands, as the sender sees it (one state, changed only by ``to``)."""

    AWAITING_HELLO = "awaiting hello"  # no setup sent: a receiver gone by now can be replaced by the next hello
    OFFERED = "offered"  # setup sent: the receiver may still be mapping the bucket; buckets queue meanwhile
    STREAMING = "streaming"  # the receiver said ready: it mapped the bucket
    DRAINING = "draining"  # every bucket sent; waiting for the final ACK (a late ready is still taken)
    RELEASED = "released"  # the final ACK: the receiver released every view and its mapping
    PEER_FAILED = "peer failed"  # the receiver reported an error (it released before reporting)
    ABORTED = "aborted"  # this side gave up; a live receiver was sent an abort frame

    @property
    def phase(self) -> SessionPhase:
        """The protocol phase this state belongs to, as messages name it."""
        return _PHASE_OF[self]

    @property
    def setup_sent(self) -> bool:
        """Whether the receiver may hold (or be making) a mapping of the bucket."""
        return self in (SendState.OFFERED, SendState.STREAMING, SendState.DRAINING)

    def to(self, new: SendState) -> SendState:
        """``new``, if this state may become it; else TransferError (a bug, or a peer breaking the protocol)."""
        if new not in _NEXT[self]:
            raise TransferError(f"send session cannot go from {self.value!r} to {new.value!r}")
        return new


_PHASE_OF = {
    SendState.AWAITING_HELLO: SessionPhase.HANDSHAKE,
    SendState.OFFERED: SessionPhase.STREAMING,
    SendState.STREAMING: SessionPhase.STREAMING,
    SendState.DRAINING: SessionPhase.DRAINING,
    SendState.RELEASED: SessionPhase.RELEASED,
    SendState.PEER_FAILED: SessionPhase.RELEASED,
    SendState.ABORTED: SessionPhase.RELEASED,
}
_NEXT: dict[SendState, frozenset[SendState]] = {
    SendState.AWAITING_HELLO: frozenset({SendState.OFFERED, SendState.ABORTED}),
    SendState.OFFERED: frozenset({SendState.STREAMING, SendState.DRAINING, SendState.PEER_FAILED, SendState.ABORTED}),
    SendState.STREAMING: frozenset({SendState.DRAINING, SendState.PEER_FAILED, SendState.ABORTED}),
    SendState.DRAINING: frozenset({SendState.RELEASED, SendState.PEER_FAILED, SendState.ABORTED}),
    SendState.RELEASED: frozenset(),
    SendState.PEER_FAILED: frozenset(),
    SendState.ABORTED: frozenset(),
}


_UNCHECKED: object = object()  # a knob this end does not have


def checked_knobs(
    *, timeout_s: object, bucket_bytes: object = _UNCHECKED, transport: object = _UNCHECKED, min_bucket_bytes: int = 1
) -> tuple[float, int | None, str | None]:
    """``timeout_s`` as a float, ``bucket_bytes`` as an int, ``transport`` as is (None for a knob not
    given), or InvalidInput naming the knob, the value and what is accepted. Both ends' constructors use it."""
    seconds = checked_seconds(timeout_s, "timeout_s")
    size = None
    if bucket_bytes is not _UNCHECKED:
        try:
            size = operator.index(bucket_bytes) if not isinstance(bucket_bytes, bool) else None
        except TypeError:
            size = None
        if size is None or size < min_bucket_bytes:
            raise InvalidInput(f"bucket_bytes={bucket_bytes!r}; need an int of at least {min_bucket_bytes}")
    if transport is _UNCHECKED:
        transport = None
    elif not isinstance(transport, str) or transport not in TRANSPORTS:
        raise InvalidInput(f"transport={transport!r}; expected one of {TRANSPORTS}")
    return seconds, size, transport  # type: ignore[return-value]


@dataclass(frozen=True)
class TransferStats:
    """What one session moved and how long it took, as seen by one side."""

    bytes: int
    tensors: int
    buckets: int
    seconds: float
    ack_wait_s: float

    @property
    def gbps(self) -> float:
        """Decimal gigabytes per second (0.0 when nothing moved)."""
        return gbps(self.bytes, self.seconds)


def checked_device(device: object) -> torch.device:
    """``device`` as a torch.device of a kind this process has (cpu, or cuda with CUDA present); else InvalidInput."""
    try:
        checked = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError) as exc:
        raise InvalidInput(f"device={device!r} is not a device ({exc}); use cpu or cuda") from None
    if checked.type not in ("cpu", "cuda"):
        raise InvalidInput(f"device={device!r}; use cpu or cuda")
    if checked.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInput(f"device={device!r}, but this process sees no CUDA device; use device='cpu'")
    return checked
