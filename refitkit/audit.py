"""Offload/reload cycles on a demo model under all four watchers: the body of `refitkit audit` (the CLI prints)."""

from __future__ import annotations

import gc
import mmap
from dataclasses import dataclass, field

import torch

from refitkit.engines.fsdp import FSDPAdapter
from refitkit.offload import flush_device
from refitkit.watchdog import CycleAudit, CycleReport, GcMonitor, GpuMemoryAudit, RSSWatchdog, WatchdogVerdict

MIB = 1 << 20
PLANTED_BYTES = 4 * MIB  # what --plant bytes leaks per cycle
PHASES = ("train", "offload", "reload")


@dataclass
class AuditRun:
    """Everything one audit run observed, for the table and the plot."""

    device: str
    cycles: int
    verdicts: list[WatchdogVerdict] = field(default_factory=list)
    rss_points: list[tuple[int, str, int]] = field(default_factory=list)  # (cycle, phase, bytes)
    gpu_points: list[tuple[int, str, int, int]] = field(default_factory=list)  # (cycle, phase, allocated, reserved)
    gpu_retained_bytes: int = 0
    gpu_available: bool = False
    gpu_summary: str = ""
    cycle_report: CycleReport | None = None
    gc_monitor: GcMonitor | None = None


class _Planted:
    """Holds itself: the reference cycle `--plant cycle` leaves behind each cycle."""


def _demo_model(width: int, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _one_cycle(adapter: FSDPAdapter, *, width: int, device: torch.device, plant: str, hoard: list, marks) -> None:
    """Train step, offload everything, reload everything; ``marks(phase)`` after each phase."""
    model, optimizer = adapter.model_parts[0], adapter.optimizers[0]
    model(torch.randn(32, width, device=device)).square().mean().backward()
    optimizer.step()
    marks("train")
    adapter.offload()  # params, AdamW state; grads dropped
    flush_device(device)
    if plant == "cycle":
        holder = _Planted()
        holder.me, holder.payload = holder, torch.ones(MIB // 4)  # 1 MiB held only by the cycle
        del holder
    marks("offload")
    adapter.reload()  # grads come back as zeros
    flush_device(device)
    if plant == "bytes":
        # a fresh anonymous mapping, every page written: new resident memory, never heap space that
        # glibc could recycle from frees earlier in the process (which would hide the leak)
        # 4 MiB: well above the default 1 MiB/cycle threshold, so the trend is judged a leak every run (at 1 MiB the
        # measured slope straddled the threshold and the audit said "ok" on its own planted leak in 2 runs of 3)
        page = mmap.mmap(-1, PLANTED_BYTES)
        page.write(b"\x01" * PLANTED_BYTES)
        hoard.append(page)
    marks("reload")


def run_audit(
    *,
    cycles: int = 30,
    width: int = 512,
    plant: str = "none",
    window: int = 20,
    warmup: int = 5,
    threshold_mib_per_cycle: float = 1.0,
    memory_history: str | None = None,
) -> AuditRun:
    """Run ``cycles`` watched cycles plus one under ``CycleAudit``; returns what was seen."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    adapter = FSDPAdapter(*_demo_model(width, device), zero_grads=True)
    run = AuditRun(device=str(device), cycles=cycles)
    rss = RSSWatchdog(
        window=window, warmup=warmup, threshold_mib_per_cycle=threshold_mib_per_cycle, on_leak=lambda v: None
    )
    gpu = GpuMemoryAudit()
    # allocator history costs a few µs an allocation: record only the last cycle
    history = GpuMemoryAudit(record_history=True, snapshot_path=memory_history) if memory_history else None
    run.gpu_available = gpu.available
    monitor = GcMonitor()
    run.gc_monitor = monitor
    hoard: list[mmap.mmap] = []
    was_enabled = gc.isenabled()
    if plant == "cycle":
        gc.disable()  # the planted cycles leak only while nothing collects them
    try:
        with monitor:
            for cycle in range(1, cycles + 1):
                watcher = history if history is not None and cycle == cycles else gpu

                def marks(phase: str, watcher: GpuMemoryAudit = watcher) -> None:
                    rss.mark(phase)
                    watcher.mark(phase)
                    monitor.mark(phase)

                watcher.begin_cycle()
                _one_cycle(adapter, width=width, device=device, plant=plant, hoard=hoard, marks=marks)
                verdict = rss.end_cycle()
                run.verdicts.append(verdict)
                run.rss_points += [(cycle, phase, nbytes) for phase, nbytes in verdict.samples]
                report = watcher.end_cycle()
                run.gpu_points += [(cycle, s.phase, s.allocated_bytes, s.reserved_bytes) for s in report.samples]
                run.gpu_retained_bytes = watcher.retained_after("reload")
                run.gpu_summary = report.summary() if report.alive_blocks else ""
        audit = CycleAudit()
        with audit:
            _one_cycle(adapter, width=width, device=device, plant=plant, hoard=hoard, marks=lambda phase: None)
        run.cycle_report = audit.report
    finally:
        if was_enabled:
            gc.enable()
    return run


def plot_audit(run: AuditRun, path: str) -> None:
    """A PNG of host RSS and GPU memory after every phase of every cycle (needs the `plot` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (host, device) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)

    def x_of(cycle: int, phase: str) -> float:
        return cycle - 1 + (PHASES.index(phase) + 1) / len(PHASES)

    for phase in PHASES:
        points = [(x_of(c, p), nbytes / MIB) for c, p, nbytes in run.rss_points if p == phase]
        host.plot([x for x, _ in points], [y for _, y in points], marker=".", label=f"after {phase}")
    host.set_ylabel("host RSS (MiB)")
    host.legend(loc="upper left")
    if run.gpu_available:
        xs = [x_of(c, p) for c, p, _, _ in run.gpu_points]
        device.plot(xs, [g[2] / MIB for g in run.gpu_points], marker=".", label="allocated")
        device.plot(xs, [g[3] / MIB for g in run.gpu_points], marker=".", label="reserved")
        device.legend(loc="upper left")
    else:
        device.text(0.5, 0.5, "no CUDA device", ha="center", va="center", transform=device.transAxes)
    device.set_ylabel("GPU memory (MiB)")
    device.set_xlabel("cycle")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
