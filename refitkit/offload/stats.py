"""Per-phase figures of a move: what moved and how fast."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoveStats:
    """Bytes and unique storages moved by one offload or reload call, and how long it took."""

    bytes: int
    storages: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Decimal gigabytes per second (0.0 when nothing moved)."""
        if self.bytes == 0 or self.seconds <= 0.0:
            return 0.0
        return self.bytes / self.seconds / 1e9

    def __add__(self, other: "MoveStats") -> "MoveStats":
        return MoveStats(
            bytes=self.bytes + other.bytes,
            storages=self.storages + other.storages,
            seconds=self.seconds + other.seconds,
        )


EMPTY_MOVE = MoveStats(bytes=0, storages=0, seconds=0.0)
