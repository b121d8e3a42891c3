"""GpuMemoryAudit: allocated and reserved GPU memory per phase, and what is still alive after cleanup."""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from refitkit.errors import InvalidInput, LeakDetected

logger = logging.getLogger(__name__)

NO_CUDA = "no CUDA device: GpuMemoryAudit records nothing and reports 0"


@dataclass(frozen=True)
class GpuSample:
    """Caching-allocator figures at one phase boundary."""

    phase: str
    allocated_bytes: int
    reserved_bytes: int


@dataclass(frozen=True)
class AliveBlock:
    """A block still allocated after cleanup that was allocated while history was recorded."""

    size_bytes: int
    address: int
    allocated_at: tuple[str, ...]  # innermost-last "file:line in function" frames (a few)


@dataclass(frozen=True)
class GpuCycleReport:
    """One audited cycle: baseline, per-phase samples and (with history) the blocks left alive."""

    baseline: GpuSample
    samples: tuple[GpuSample, ...]
    alive_blocks: tuple[AliveBlock, ...] = ()
    snapshot_path: str | None = None

    def summary(self, *, top: int = 5) -> str:
        """A few lines: the largest blocks still alive and where they were allocated."""
        if not self.alive_blocks:
            return "no block allocated during the cycle is still alive"
        lines = [f"{len(self.alive_blocks)} blocks allocated during the cycle are still alive:"]
        for block in self.alive_blocks[:top]:
            where = block.allocated_at[-1] if block.allocated_at else "(no Python frame)"
            lines.append(f"  {block.size_bytes} B at {where}")
        return "\n".join(lines)


class GpuMemoryAudit:
    """Samples allocated/reserved GPU memory at phase boundaries and checks what a cycle retains.

    ``begin_cycle()`` takes the baseline, ``mark(phase)`` samples when a phase has just finished
    (the same convention as ``RSSWatchdog.mark``), ``retained_after(phase)`` is the growth since
    the baseline, and ``end_cycle()`` returns a report. With ``record_history=True`` the cycle
    runs under the caching allocator's memory history: ``end_cycle()`` dumps a snapshot (to
    ``snapshot_path`` when given) and lists blocks allocated during the cycle that are still
    alive, with their allocation frames. Without CUDA every method is a no-op reporting 0.
    """

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        *,
        record_history: bool = False,
        snapshot_path: str | Path | None = None,
        max_history_entries: int = 100_000,
    ) -> None:
        self.available = torch.cuda.is_available()
        if not self.available:
            logger.info(NO_CUDA)
            self.device = None
        else:
            self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else _cuda_device(device)
        self.record_history = record_history and self.available
        self.snapshot_path = Path(snapshot_path) if snapshot_path is not None else None
        self.max_history_entries = max_history_entries
        self._baseline = GpuSample("(baseline)", 0, 0)
        self._samples: list[GpuSample] = []
        self._recording = False

    def sample(self, phase: str) -> GpuSample:
        """Current allocated/reserved bytes (0 without CUDA), labelled ``phase``."""
        if not self.available:
            return GpuSample(phase, 0, 0)
        stats = torch.cuda.memory_stats(self.device)  # one stats call for both figures (~150 us)
        return GpuSample(phase, stats.get("allocated_bytes.all.current", 0), stats.get("reserved_bytes.all.current", 0))

    def begin_cycle(self) -> GpuSample:
        """Take the baseline (and start recording history when asked)."""
        self._samples = []
        if self.record_history and not self._recording:
            _start_history(self.device, self.max_history_entries)
            self._recording = True
        self._baseline = self.sample("(baseline)")
        return self._baseline

    def mark(self, phase: str) -> GpuSample:
        """``phase`` just finished: sample now."""
        sample = self.sample(phase)
        self._samples.append(sample)
        return sample

    def retained_after(self, phase: str, *, kind: Literal["allocated", "reserved"] = "allocated") -> int:
        """Bytes more than the baseline at the last ``mark(phase)`` of this cycle (never negative)."""
        if kind not in ("allocated", "reserved"):
            raise InvalidInput(f"retained_after(kind={kind!r}): expected 'allocated' or 'reserved'")
        sample = self._last(phase)
        if kind == "allocated":
            return max(0, sample.allocated_bytes - self._baseline.allocated_bytes)
        return max(0, sample.reserved_bytes - self._baseline.reserved_bytes)

    def check_retained(
        self, phase: str, *, tolerance_bytes: int = 0, kind: Literal["allocated", "reserved"] = "allocated"
    ) -> None:
        """Raise ``LeakDetected`` if more than ``tolerance_bytes`` are retained after ``phase``."""
        retained = self.retained_after(phase, kind=kind)
        if retained > tolerance_bytes:
            raise LeakDetected(
                f"GPU memory {kind} after phase {phase!r} is {retained} B above the cycle's baseline on "
                f"{self.device} (tolerance_bytes={tolerance_bytes}); run with record_history=True to see where it was allocated"
            )

    def end_cycle(self) -> GpuCycleReport:
        """Close the cycle; with history, snapshot, stop recording and list blocks still alive."""
        alive: tuple[AliveBlock, ...] = ()
        path: str | None = None
        if self._recording:
            try:
                snapshot = _snapshot(self.device)
                alive = alive_blocks(snapshot)
                if self.snapshot_path is not None:
                    self.snapshot_path.parent.mkdir(parents=True, exist_ok=True)
                    with open(self.snapshot_path, "wb") as out:
                        pickle.dump(snapshot, out)  # torch's memory_viz reads this format
                    path = str(self.snapshot_path)
            finally:
                _stop_history(self.device)
                self._recording = False
        return GpuCycleReport(self._baseline, tuple(self._samples), alive, path)

    def _last(self, phase: str) -> GpuSample:
        for sample in reversed(self._samples):
            if sample.phase == phase:
                return sample
        if not self.available:
            return GpuSample(phase, 0, 0)
        marked = sorted({s.phase for s in self._samples})
        raise InvalidInput(f"retained_after({phase!r}): no mark({phase!r}) in this cycle (marked: {marked})")


def _cuda_device(device: torch.device | str | int) -> torch.device:
    resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if resolved.type != "cuda":
        raise InvalidInput(f"GpuMemoryAudit(device={device!r}): expected a CUDA device")
    if resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _start_history(device: torch.device | None, max_entries: int) -> None:
    """Start torch's private allocator history (checked against torch 2.11 and 2.13)."""
    with torch.cuda.device(device):
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=max_entries)


def _stop_history(device: torch.device | None) -> None:
    """Stop torch's private allocator history (checked against torch 2.11 and 2.13)."""
    with torch.cuda.device(device):
        torch.cuda.memory._record_memory_history(enabled=None)


def _snapshot(device: torch.device | None) -> dict[str, Any]:
    """torch's private allocator snapshot, segments and traces (checked against torch 2.11 and 2.13)."""
    with torch.cuda.device(device):
        return torch.cuda.memory._snapshot()


def alive_blocks(snapshot: dict[str, Any], *, frames: int = 3) -> tuple[AliveBlock, ...]:
    """Allocated blocks that carry allocation frames (i.e. were allocated while history ran), largest first.

    Reads the snapshot layout of torch 2.11 / 2.13 (segments -> blocks with state and frames).
    """
    found: list[AliveBlock] = []
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated" or not block.get("frames"):
                continue
            python_frames = [f for f in block["frames"] if f.get("filename", "").endswith(".py")]
            chosen = _user_frames(python_frames or block["frames"])[:frames]
            where = tuple(
                f"{f.get('filename', '?')}:{f.get('line', '?')} in {f.get('name', '?')}" for f in reversed(chosen)
            )
            found.append(AliveBlock(int(block.get("requested_size") or block["size"]), int(block["address"]), where))
    found.sort(key=lambda block: block.size_bytes, reverse=True)
    return tuple(found)


def _user_frames(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Frames innermost first, skipping torch's own files so the caller's line comes first."""
    outside = [f for f in frames if "/torch/" not in f.get("filename", "")]
    return outside or frames
