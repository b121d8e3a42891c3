"""What both wings of ``refitkit.transfer`` share: the phases of a session (named in every timeout and
error), the figures a session reports, the weight version a receiver holds, and the knob checks."""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass

import torch

from refitkit._knobs import MAX_TIMEOUT_S, checked_seconds  # noqa: F401  (MAX_TIMEOUT_S: re-exported)
from refitkit.errors import ChannelClosed, InvalidInput
from refitkit.report import gbps, repr_with_gbps

TRANSPORTS = ("auto", "cuda_ipc", "shm")
# The longest timeout_s any wait can hold: ZMQ polls take a C int of milliseconds (2**31 ms is 24.8
# days), and a deadline must stay finite. One week is far beyond any real sync.


class SessionPhase(enum.Enum):
    """Where a transfer session stands; named in every timeout and error message."""

    HANDSHAKE = "handshake"  # hello / setup / ready: the receiver maps the bucket buffer
    STREAMING = "streaming"  # buckets flow; the sender packs i+1 while the receiver consumes i
    DRAINING = "draining"  # last bucket sent; waiting for the receiver to release and ACK
    RELEASED = "released"  # bucket memory freed on both sides (success or failure)


class ChannelState(enum.Enum):
    """Where a transfer channel (one end of a trainer-engine link) stands: open between syncs, in one sync, or
    closed. A failed sync ends that sync only: its channel is open again for the next."""

    OPEN = "open"  # connected (or bound) and idle: the next sync may start
    EXCHANGING = "exchanging"  # one sync runs on it
    CLOSED = "closed"  # close() ran, or the process that opened it is not this one: nothing of it is held

    def to(self, new: ChannelState) -> ChannelState:
        """``new``, if this state may become it; else ChannelClosed (a closed channel stays closed)."""
        if new not in _CHANNEL_NEXT[self]:
            raise ChannelClosed(f"a {self.value} channel cannot become {new.value}")
        return new


_CHANNEL_NEXT = {
    ChannelState.OPEN: frozenset({ChannelState.EXCHANGING, ChannelState.CLOSED}),
    ChannelState.EXCHANGING: frozenset({ChannelState.OPEN, ChannelState.CLOSED}),
    ChannelState.CLOSED: frozenset({ChannelState.CLOSED}),
}


_UNCHECKED: object = object()  # a knob this end does not have

# The largest bucket_bytes a sender takes, and why: one piece of memory, mapped whole into the sender's and the
# receiver's address space (shm) or allocated on one GPU (cuda_ipc); a bucket of a few GiB already saturates a copy.
MAX_BUCKET_BYTES = 1 << 40
BUCKET_LIMIT = "1 TiB, the most a transport maps or allocates as one bucket; a few GiB saturate the copies"


def checked_knobs(
    *,
    timeout_s: object,
    bucket_bytes: object = _UNCHECKED,
    transport: object = _UNCHECKED,
    min_bucket_bytes: int = 1,
    max_bucket_bytes: tuple[int, str] = (MAX_BUCKET_BYTES, BUCKET_LIMIT),
) -> tuple[float, int | None, str | None]:
    """``timeout_s`` as a float, ``bucket_bytes`` as an int, ``transport`` as is (None for a knob not
    given), or InvalidInput naming the knob, the value and what is accepted (``max_bucket_bytes``: the largest
    bucket and why). Both ends' constructors use it."""
    seconds = checked_seconds(timeout_s, "timeout_s")
    size = None
    if bucket_bytes is not _UNCHECKED:
        try:
            size = operator.index(bucket_bytes) if not isinstance(bucket_bytes, bool) else None
        except TypeError:
            size = None
        largest, why = max_bucket_bytes
        if size is None or not min_bucket_bytes <= size <= largest:
            raise InvalidInput(
                f"bucket_bytes={bucket_bytes!r}; need an int of at least {min_bucket_bytes} and at most {largest} "
                f"({why})"
            )
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

    __repr__ = repr_with_gbps


@dataclass(frozen=True)
class DirectSplit:
    """How a sender with ``direct=True`` moved one session: tensors read where they lie, or through the bucket (and why)."""

    direct_tensors: int
    direct_bytes: int
    bucket_tensors: int
    bucket_bytes: int
    allocations: int  # the sender's allocations the receiver mapped
    bucket_reasons: dict[str, int]  # why tensors went through the bucket -> how many
    # fresh tensors (``FreshWeights``): allocations returned to the driver during the sync and made again at an
    # exported address, each exported anew (so counted in ``allocations`` twice)
    replaced_allocations: int = 0


def checked_device(device: object) -> torch.device:
    """``device`` as a torch.device of a kind this process has (cpu, or cuda with CUDA present); else InvalidInput."""
    try:
        checked = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError) as exc:
        raise InvalidInput(f"device={device!r} is not a device ({exc}); use cpu or cuda") from exc
    if checked.type not in ("cpu", "cuda"):
        raise InvalidInput(f"device={device!r}; use cpu or cuda")
    if checked.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInput(f"device={device!r}, but this process sees no CUDA device; use device='cpu'")
    return checked


def checked_version(version: object) -> int:
    """A weight version is an int in [0, 2**63): the RL loop's step, or any counter it keeps."""
    if isinstance(version, bool):
        raise InvalidInput(f"version={version!r}; need an int >= 0 (e.g. the training step)")
    try:
        value = operator.index(version)
    except TypeError as exc:
        raise InvalidInput(
            f"version={version!r} is a {type(version).__name__}; need an int >= 0 (e.g. the training step)"
        ) from exc
    if not 0 <= value < 1 << 63:
        raise InvalidInput(f"version={version!r}; need an int >= 0 and below 2**63")
    return value


@dataclass(frozen=True)
class WeightVersion:
    """Which weights a receiver holds: ``version`` of the last session that landed whole (None: none yet), and
    ``incomplete``, the version of a session that failed part-way since then (None when the weights are clean)."""

    version: int | None = None
    incomplete: int | None = None

    @property
    def clean(self) -> bool:
        """Whether every weight is the one of ``version`` (no failed session touched them since)."""
        return self.incomplete is None
