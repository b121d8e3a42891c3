"""The phases of one transfer session, and the figures a session reports."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class SessionPhase(enum.Enum):
    """Where a transfer session stands; named in every timeout and error message."""

    HANDSHAKE = "handshake"  # hello / setup / ready: the receiver maps the bucket buffer
    STREAMING = "streaming"  # buckets flow; the sender packs i+1 while the receiver consumes i
    DRAINING = "draining"  # last bucket sent; waiting for the receiver to release and ACK
    RELEASED = "released"  # bucket memory freed on both sides (success or failure)


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
        if self.bytes == 0 or self.seconds <= 0.0:
            return 0.0
        return self.bytes / self.seconds / 1e9
