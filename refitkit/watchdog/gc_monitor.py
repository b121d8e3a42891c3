"""GcMonitor: every garbage collection, its generation, its pause, its phase, and who asked for it."""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

UNMARKED_PHASE = "(unmarked)"
_GENERATIONS = len(gc.get_threshold())

# Explicit collections are flagged by a thin wrapper installed as ``gc.collect`` while any
# monitor runs (one shared install, counted). Collections it did not flag are classified by
# CPython's own trigger rule: it starts one automatically only while enabled and when the
# generation's count is past its threshold (gc_collect_generations in CPython 3.11/3.12 gcmodule.c).
_flag = threading.local()
_install_lock = threading.Lock()
_installs = 0
_original_collect = gc.collect


@functools.wraps(_original_collect)
def _flagging_collect(generation: int = 2) -> int:
    _flag.depth = getattr(_flag, "depth", 0) + 1
    try:
        return _original_collect(generation)
    finally:
        _flag.depth -= 1


def _install() -> None:
    global _installs, _original_collect
    with _install_lock:
        if _installs == 0 and gc.collect is not _flagging_collect:
            _original_collect = gc.collect
            gc.collect = _flagging_collect
        _installs += 1


def _uninstall() -> None:
    global _installs
    with _install_lock:
        _installs -= 1
        if _installs == 0:
            if gc.collect is _flagging_collect:
                gc.collect = _original_collect
            else:  # someone wrapped gc.collect after us; unwinding theirs would break them
                logger.debug("GcMonitor: gc.collect was replaced while monitoring; leaving it as is")


def _started_automatically(generation: int) -> bool:
    thresholds, counts = gc.get_threshold(), gc.get_count()
    return gc.isenabled() and thresholds[0] > 0 and counts[generation] > thresholds[generation]


@dataclass(frozen=True)
class GcEvent:
    """One collection."""

    generation: int
    explicit: bool  # gc.collect() (or a C-level PyGC_Collect), not CPython's own trigger
    pause_s: float
    collected: int
    uncollectable: int
    phase: str


@dataclass
class GcPhaseSummary:
    """Collections charged to one phase."""

    automatic_by_generation: list[int] = field(default_factory=lambda: [0] * _GENERATIONS)
    explicit: int = 0
    automatic_s: float = 0.0
    explicit_s: float = 0.0
    max_pause_s: float = 0.0
    collected: int = 0

    @property
    def automatic(self) -> int:
        return sum(self.automatic_by_generation)

    def add(self, event: GcEvent) -> None:
        if event.explicit:
            self.explicit += 1
            self.explicit_s += event.pause_s
        else:
            self.automatic_by_generation[event.generation] += 1
            self.automatic_s += event.pause_s
        self.max_pause_s = max(self.max_pause_s, event.pause_s)
        self.collected += event.collected


class GcMonitor:
    """Counts and times every collection per generation and per phase, automatic vs explicit.

    Runs while started (``start()``/``stop()`` or ``with GcMonitor() as monitor:``) through
    ``gc.callbacks``. Charge collections to a phase with ``with monitor.phase("offload"):``, or
    call ``mark(phase)`` when a phase has just finished (collections since the previous mark are
    charged to it, the same convention as ``RSSWatchdog.mark``). Explicit collections are
    recognised by a wrapper around ``gc.collect`` installed while monitoring; a collection the
    wrapper did not see (a ``collect`` bound before monitoring, a C extension) counts as
    explicit unless CPython's own trigger condition held. Costs two callbacks a collection and
    nothing between collections.
    """

    def __init__(self, *, max_events: int = 10_000) -> None:
        self.events: deque[GcEvent] = deque(maxlen=max_events)
        self._max_pending = max_events
        self._summaries: dict[str, GcPhaseSummary] = {}
        self._pending: list[GcEvent] = []
        self._current_phase: str | None = None
        self._started_ns = 0
        self._start_explicit = False
        self._running = False

    def start(self) -> GcMonitor:
        """Begin receiving collection callbacks (idempotent)."""
        if not self._running:
            _install()
            gc.callbacks.append(self._on_gc)
            self._running = True
        return self

    def stop(self) -> None:
        """Stop receiving callbacks; what was counted stays readable."""
        if self._running:
            gc.callbacks.remove(self._on_gc)
            _uninstall()
            self._running = False
            self._flush(UNMARKED_PHASE)

    def __enter__(self) -> GcMonitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Charge collections inside the block to ``name``."""
        self._flush(UNMARKED_PHASE)
        previous, self._current_phase = self._current_phase, name
        try:
            yield
        finally:
            self._current_phase = previous

    def mark(self, phase: str) -> None:
        """``phase`` just finished: charge the collections since the previous mark to it."""
        self._flush(phase)

    def summary(self) -> dict[str, GcPhaseSummary]:
        """Per-phase counts and pauses so far (collections not yet charged show as "(unmarked)")."""
        result = {name: _copy(s) for name, s in self._summaries.items()}
        if self._pending:
            pending = result.setdefault(UNMARKED_PHASE, GcPhaseSummary())
            for event in self._pending:
                pending.add(event)
        return result

    def totals(self) -> GcPhaseSummary:
        """All phases together."""
        total = GcPhaseSummary()
        for event_summary in self.summary().values():
            for generation, count in enumerate(event_summary.automatic_by_generation):
                total.automatic_by_generation[generation] += count
            total.explicit += event_summary.explicit
            total.automatic_s += event_summary.automatic_s
            total.explicit_s += event_summary.explicit_s
            total.max_pause_s = max(total.max_pause_s, event_summary.max_pause_s)
            total.collected += event_summary.collected
        return total

    def _on_gc(self, stage: str, info: dict[str, Any]) -> None:
        if stage == "start":
            self._start_explicit = getattr(_flag, "depth", 0) > 0 or not _started_automatically(info["generation"])
            self._started_ns = time.perf_counter_ns()
            return
        pause_s = (time.perf_counter_ns() - self._started_ns) / 1e9
        event = GcEvent(
            generation=info["generation"],
            explicit=self._start_explicit,
            pause_s=pause_s,
            collected=info.get("collected", 0),
            uncollectable=info.get("uncollectable", 0),
            phase=self._current_phase or "",
        )
        if self._current_phase is not None:
            self._record(event)
        else:
            self._pending.append(event)
            if len(self._pending) >= self._max_pending:  # never marked: bound what we hold
                self._flush(UNMARKED_PHASE)

    def _flush(self, phase: str) -> None:
        pending, self._pending = self._pending, []
        for event in pending:
            self._record(
                GcEvent(event.generation, event.explicit, event.pause_s, event.collected, event.uncollectable, phase)
            )

    def _record(self, event: GcEvent) -> None:
        self.events.append(event)
        self._summaries.setdefault(event.phase, GcPhaseSummary()).add(event)


def _copy(summary: GcPhaseSummary) -> GcPhaseSummary:
    return GcPhaseSummary(
        list(summary.automatic_by_generation),
        summary.explicit,
        summary.automatic_s,
        summary.explicit_s,
        summary.max_pause_s,
        summary.collected,
    )
