"""Watchdogs and audits: host RSS trends, reference cycles, GC activity and GPU retention.

Everything here only observes. ``CycleAudit`` (and ``assert_no_cycles``) is the one opt-in
place in refitkit that runs ``gc.collect()``.
"""

from refitkit.watchdog.cycles import CycleAudit, CycleReport, CyclicTensor, assert_no_cycles
from refitkit.watchdog.gc_monitor import GcEvent, GcMonitor, GcPhaseSummary
from refitkit.watchdog.gpu import AliveBlock, GpuCycleReport, GpuMemoryAudit, GpuSample
from refitkit.watchdog.rss import RSSWatchdog, WatchdogVerdict, rss_sampler, uss_sampler

__all__ = [
    "AliveBlock",
    "CycleAudit",
    "CycleReport",
    "CyclicTensor",
    "GcEvent",
    "GcMonitor",
    "GcPhaseSummary",
    "GpuCycleReport",
    "GpuMemoryAudit",
    "GpuSample",
    "RSSWatchdog",
    "WatchdogVerdict",
    "assert_no_cycles",
    "rss_sampler",
    "uss_sampler",
]
