"""Per-phase figures of a move: what moved and how fast."""

from __future__ import annotations

from dataclasses import dataclass

from refitkit.report import gbps, repr_with_gbps


@dataclass(frozen=True)
class MoveStats:
    """Bytes and unique storages moved by one offload or reload call, and how long it took."""

    bytes: int
    storages: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Decimal gigabytes per second (0.0 when nothing moved)."""
        return gbps(self.bytes, self.seconds)

    __repr__ = repr_with_gbps

    def __add__(self, other: MoveStats) -> MoveStats:
        return MoveStats(
            bytes=self.bytes + other.bytes,
            storages=self.storages + other.storages,
            seconds=self.seconds + other.seconds,
        )


EMPTY_MOVE = MoveStats(bytes=0, storages=0, seconds=0.0)
