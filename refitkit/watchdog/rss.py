"""RSSWatchdog: is host memory growing cycle after cycle, and in which phase?"""

from __future__ import annotations

import logging
import os
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from statistics import median
from typing import Literal

from refitkit.errors import InvalidInput, LeakDetected
from refitkit.watchdog._trend import mann_kendall_p_increasing, theil_sen_slope

logger = logging.getLogger(__name__)

MIB = 1 << 20
UNMARKED_PHASE = "(unmarked)"

Sampler = Callable[[], int]
LeakAction = Literal["log", "raise"] | Callable[["WatchdogVerdict"], None]


@dataclass(frozen=True)
class WatchdogVerdict:
    """What one ``end_cycle()`` concluded about host memory."""

    cycle: int  # 1-based index of the cycle that just ended
    status: Literal["warmup", "ok", "growing"]
    leaking: bool
    slope_mib_per_cycle: float  # Theil–Sen over the window; 0.0 during warm-up
    phase: str | None  # phase whose growth dominates, set when growing
    window: int  # cycle-end samples the decision used (0 during warm-up)
    p_value: float  # one-sided Mann–Kendall p-value of an upward trend
    rss_bytes: int  # at the end of this cycle
    uss_bytes: int | None = None  # with track_uss=True
    # each phase's own growth per cycle (median over the window), in cycle order
    growth_by_phase_mib: Mapping[str, float] = field(default_factory=dict)
    samples: tuple[tuple[str, int], ...] = ()  # (phase, rss_bytes) taken in this cycle

    def describe(self) -> str:
        """One line for logs and error messages."""
        if self.status == "warmup":
            return f"cycle {self.cycle}: warming up, RSS {self.rss_bytes / MIB:.1f} MiB"
        where = ""
        if self.phase is not None:
            where = f", in phase {self.phase!r} (+{self.growth_by_phase_mib[self.phase]:.2f} MiB/cycle)"
        return (
            f"cycle {self.cycle}: host RSS {self.status}, {self.slope_mib_per_cycle:+.2f} MiB/cycle over the "
            f"last {self.window} cycles (p={self.p_value:.2g}){where}; RSS {self.rss_bytes / MIB:.1f} MiB"
        )


class _ProcFileSampler:
    """Reads one number from a /proc file through a kept-open descriptor (a few µs a read)."""

    def __init__(self, path: str) -> None:
        self._path = path
        self._pid = -1
        self._fd = -1
        self._finalizer: weakref.finalize | None = None

    def _open(self) -> int:
        # /proc/self resolves at open time: a forked child must reopen or it reads its parent
        if self._finalizer is not None:
            self._finalizer()
        self._fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
        self._pid = os.getpid()
        self._finalizer = weakref.finalize(self, os.close, self._fd)
        return self._fd

    def read(self) -> bytes:
        fd = self._fd if self._pid == os.getpid() else self._open()
        return os.pread(fd, 4096, 0)


def rss_sampler() -> Sampler:
    """The cheapest resident-set-size reader on this platform: /proc/self/statm, else psutil."""
    if os.path.exists("/proc/self/statm"):
        statm = _ProcFileSampler("/proc/self/statm")
        page_bytes = os.sysconf("SC_PAGE_SIZE")
        return lambda: int(statm.read().split()[1]) * page_bytes
    import psutil

    process = psutil.Process()
    return lambda: process.memory_info().rss


def uss_sampler() -> Sampler | None:
    """Unique set size (private pages) reader, or None where the platform cannot give it.

    Costs ~0.2–1 ms a read (the kernel walks every mapping), so it is sampled once a cycle.
    """
    if os.path.exists("/proc/self/smaps_rollup"):
        return _read_smaps_rollup_uss
    try:
        import psutil

        process = psutil.Process()
        process.memory_full_info()
    except Exception:  # not supported here (permissions or platform)
        return None
    return lambda: process.memory_full_info().uss


def _read_smaps_rollup_uss() -> int:
    total_kib = 0
    with open("/proc/self/smaps_rollup", "rb") as rollup:
        for line in rollup:
            if line.startswith((b"Private_Clean:", b"Private_Dirty:", b"Private_Hugetlb:")):
                total_kib += int(line.split()[1])
    return total_kib * 1024


def _explaining_phase(growth: dict[str, float], slope_mib: float) -> str:
    """The phase whose own growth best accounts for the cycle's net growth.

    A phase qualifies when it grows by at least half the net; among those, the one closest to
    the net wins, so a pair that cancels (offload frees what reload takes back) is passed over.
    Boundary samples cannot tell "offload took 513 MiB, reload gave back 512" from "offload
    took 512, reload gave back 511"; both name offload.
    """
    candidates = [phase for phase, grown in growth.items() if grown >= slope_mib / 2]
    if not candidates:
        return max(growth, key=growth.__getitem__)
    return min(candidates, key=lambda phase: abs(growth[phase] - slope_mib))


class RSSWatchdog:
    """Watches host RSS at marked phase boundaries and flags steady growth across cycles.

    Call ``mark(phase)`` when a phase has just finished and ``end_cycle()`` once a cycle. The
    verdict's ``phase`` is the phase whose own growth best accounts for the net growth (growth
    after the last mark is charged to "(unmarked)"); a phase that frees memory another phase
    takes back in the same cycle hides a leak of its own of up to that size. After ``warmup`` cycles, each
    ``end_cycle()`` fits a Theil–Sen slope (MiB/cycle) to the last ``window`` cycle-end samples;
    memory is ``growing`` when that slope is at least ``threshold_mib_per_cycle``, the rise is
    significant (one-sided Mann–Kendall p < ``alpha``) and shows in both halves of the window,
    so spikes, a one-off step and noisy but flat memory do not alarm. ``on_leak`` ("log", "raise" for ``LeakDetected``, or a callable taking
    the verdict) fires once each time the status turns to ``growing``. Not thread-safe: call it
    from the loop it watches.
    """

    def __init__(
        self,
        *,
        window: int = 20,
        warmup: int = 5,
        threshold_mib_per_cycle: float = 1.0,
        on_leak: LeakAction = "log",
        alpha: float = 0.01,
        track_uss: bool = False,
        sampler: Sampler | None = None,
    ) -> None:
        if window < 3:
            raise InvalidInput(f"RSSWatchdog(window={window}): a trend needs at least 3 cycles")
        if warmup < 0:
            raise InvalidInput(f"RSSWatchdog(warmup={warmup}): must be >= 0")
        if not threshold_mib_per_cycle > 0:
            raise InvalidInput(f"RSSWatchdog(threshold_mib_per_cycle={threshold_mib_per_cycle}): must be > 0")
        if not 0.0 < alpha < 1.0:
            raise InvalidInput(f"RSSWatchdog(alpha={alpha}): must be in (0, 1)")
        if on_leak not in ("log", "raise") and not callable(on_leak):
            raise InvalidInput(f"RSSWatchdog(on_leak={on_leak!r}): expected 'log', 'raise' or a callable")
        self.window = window
        self.warmup = warmup
        self.threshold_mib_per_cycle = threshold_mib_per_cycle
        self.alpha = alpha
        self.on_leak = on_leak
        self._sample = sampler if sampler is not None else rss_sampler()
        self._sample_uss = uss_sampler() if track_uss else None
        self.cycle = 0
        start_bytes = self._sample()
        self._cycle_samples: list[tuple[str, int]] = []
        # point k of the window: (cycle-end bytes, that cycle's (phase, bytes) samples)
        self._points: deque[tuple[int, tuple[tuple[str, int], ...]]] = deque(maxlen=window)
        if warmup == 0:
            self._points.append((start_bytes, ()))
        self._growing = False

    def sample_bytes(self) -> int:
        """Current RSS in bytes (what ``mark`` records)."""
        return self._sample()

    def mark(self, phase: str) -> int:
        """``phase`` just finished: sample RSS now (a few µs); returns the bytes."""
        now = self._sample()
        self._cycle_samples.append((phase, now))
        return now

    def end_cycle(self) -> WatchdogVerdict:
        """Close the cycle, update the trend and act on a leak; returns this cycle's verdict."""
        now = self._sample()
        self.cycle += 1
        samples = tuple(self._cycle_samples)
        self._cycle_samples = []
        uss = self._sample_uss() if self._sample_uss is not None else None
        if self.cycle < self.warmup:
            return WatchdogVerdict(
                cycle=self.cycle,
                status="warmup",
                leaking=False,
                slope_mib_per_cycle=0.0,
                phase=None,
                window=0,
                p_value=1.0,
                rss_bytes=now,
                uss_bytes=uss,
                samples=samples,
            )
        # the last warm-up cycle's end is the window's baseline point
        self._points.append((now, samples))
        verdict = self._judge(now, uss, samples)
        if verdict.leaking and not self._growing:
            self._act(verdict)
        self._growing = verdict.leaking
        return verdict

    def _judge(self, now: int, uss: int | None, samples: tuple[tuple[str, int], ...]) -> WatchdogVerdict:
        totals = [point_bytes / MIB for point_bytes, _ in self._points]
        slope = theil_sen_slope(totals)
        p_value = mann_kendall_p_increasing(totals)
        leaking = (
            len(totals) >= 3
            and slope >= self.threshold_mib_per_cycle
            and p_value < self.alpha
            and self._rise_persists(totals)
        )
        growth = self._growth_by_phase()
        phase = _explaining_phase(growth, slope) if leaking else None
        return WatchdogVerdict(
            cycle=self.cycle,
            status="growing" if leaking else "ok",
            leaking=leaking,
            slope_mib_per_cycle=slope,
            phase=phase,
            window=len(totals),
            p_value=p_value,
            rss_bytes=now,
            uss_bytes=uss,
            growth_by_phase_mib=growth,
            samples=samples,
        )

    def _rise_persists(self, totals: list[float]) -> bool:
        """Both halves of the window rise: a one-off step (a cache growing once) is not a leak."""
        half = (len(totals) + 1) // 2
        floor = self.threshold_mib_per_cycle / 2  # halves are noisier than the whole
        return theil_sen_slope(totals[:half]) >= floor and theil_sen_slope(totals[len(totals) - half :]) >= floor

    def _growth_by_phase(self) -> dict[str, float]:
        """Each phase's own growth per cycle (median over the window, MiB), in cycle order.

        Medians shrug off one-cycle spikes. Growth after the last mark is "(unmarked)".
        """
        points = list(self._points)
        per_phase: dict[str, list[float]] = {}
        for (previous_end, _), (end, samples) in zip(points, points[1:]):
            before = previous_end
            for phase, sampled in samples:
                per_phase.setdefault(phase, []).append((sampled - before) / MIB)
                before = sampled
            per_phase.setdefault(UNMARKED_PHASE, []).append((end - before) / MIB)
        per_phase[UNMARKED_PHASE] = per_phase.pop(UNMARKED_PHASE, [0.0])  # the cycle's end comes last
        return {phase: median(values) for phase, values in per_phase.items()}

    def _act(self, verdict: WatchdogVerdict) -> None:
        message = f"RSSWatchdog: {verdict.describe()}; threshold_mib_per_cycle={self.threshold_mib_per_cycle}"
        if self.on_leak == "log":
            logger.warning(message)
        elif self.on_leak == "raise":
            error = LeakDetected(message)
            error.verdict = verdict  # type: ignore[attr-defined]  # for handlers that want the numbers
            raise error
        else:
            self.on_leak(verdict)  # type: ignore[operator]
