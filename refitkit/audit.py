"""`refitkit audit`: run offload/reload cycles on a demo model under all four watchers; print a verdict."""

from __future__ import annotations

import argparse
import gc
import mmap
import sys
from dataclasses import dataclass, field

import torch

from refitkit.offload import HostArena, flush_device, offload_grads, offload_optimizer, offload_tensors
from refitkit.offload import reload_grads, reload_optimizer, reload_tensors
from refitkit.watchdog import CycleAudit, CycleReport, GcMonitor, GpuMemoryAudit, RSSWatchdog, WatchdogVerdict

MIB = 1 << 20
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


def _one_cycle(model, optimizer, arena, *, width: int, device: torch.device, plant: str, hoard: list, marks) -> None:
    """Train step, offload everything, reload everything; ``marks(phase)`` after each phase."""
    named = list(model.named_parameters())
    model(torch.randn(32, width, device=device)).square().mean().backward()
    optimizer.step()
    marks("train")
    offload_grads(named, arena)
    offload_tensors(named, arena)
    offload_optimizer(optimizer, arena)
    flush_device(device)
    if plant == "cycle":
        holder = _Planted()
        holder.me, holder.payload = holder, torch.ones(MIB // 4)  # 1 MiB held only by the cycle
        del holder
    marks("offload")
    reload_tensors(named, arena)
    reload_optimizer(optimizer, arena)
    reload_grads(named, arena, zero=True)
    flush_device(device)
    if plant == "bytes":
        # a fresh anonymous mapping, every page written: new resident memory, never heap space that
        # glibc could recycle from frees earlier in the process (which would hide the leak)
        page = mmap.mmap(-1, MIB)
        page.write(b"\x01" * MIB)
        hoard.append(page)
    marks("reload")


def run_audit(
    *, cycles: int = 30, width: int = 512, plant: str = "none", window: int = 20, warmup: int = 5,
    threshold_mib_per_cycle: float = 1.0, memory_history: str | None = None,
) -> AuditRun:  # fmt: skip
    """Run ``cycles`` watched cycles plus one under ``CycleAudit``; returns what was seen."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model, optimizer = _demo_model(width, device)
    arena = HostArena()
    run = AuditRun(device=str(device), cycles=cycles)
    rss = RSSWatchdog(window=window, warmup=warmup, threshold_mib_per_cycle=threshold_mib_per_cycle, on_leak=lambda v: None)
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
                _one_cycle(model, optimizer, arena, width=width, device=device, plant=plant, hoard=hoard, marks=marks)
                verdict = rss.end_cycle()
                run.verdicts.append(verdict)
                run.rss_points += [(cycle, phase, nbytes) for phase, nbytes in verdict.samples]
                report = watcher.end_cycle()
                run.gpu_points += [(cycle, s.phase, s.allocated_bytes, s.reserved_bytes) for s in report.samples]
                run.gpu_retained_bytes = watcher.retained_after("reload")
                run.gpu_summary = report.summary() if report.alive_blocks else ""
        audit = CycleAudit()
        with audit:
            _one_cycle(model, optimizer, arena, width=width, device=device, plant=plant, hoard=hoard, marks=lambda phase: None)
        run.cycle_report = audit.report
    finally:
        if was_enabled:
            gc.enable()
    return run


def _verdict_rows(run: AuditRun) -> list[tuple[str, str, str]]:
    rows = []
    last = run.verdicts[-1]
    flagged = [v for v in run.verdicts if v.leaking]
    if flagged:
        first = flagged[0]
        rows.append(("host RSS", "LEAK", f"growing from cycle {first.cycle}: {last.slope_mib_per_cycle:+.2f} MiB/cycle, phase {first.phase!r}"))
    else:
        rows.append(("host RSS", "ok", f"{last.slope_mib_per_cycle:+.2f} MiB/cycle over {last.window} cycles; RSS {last.rss_bytes / MIB:.0f} MiB"))
    report = run.cycle_report
    if report is None or report.clean:
        rows.append(("reference cycles", "ok", "0 objects in cycles in one audited cycle"))
    else:
        held = ", ".join(f"{d}: {b / MIB:.2f} MiB" for d, b in report.tensor_bytes.items()) or "no tensors"
        top = ", ".join(f"{name} x{n}" for name, n in list(report.by_type.items())[:3])
        chain = " <- ".join(report.largest_chain[:3])
        rows.append(("reference cycles", "LEAK", f"{report.cyclic_objects} objects ({top}); tensors {held}; {chain}"))
    totals = run.gc_monitor.totals() if run.gc_monitor else None
    if totals is not None:
        gens = "/".join(str(n) for n in totals.automatic_by_generation)
        status = "warn" if totals.explicit else "ok"
        rows.append(("GC activity", status, f"automatic by generation {gens}, {totals.automatic_s * 1e3:.1f} ms; "
                     f"explicit {totals.explicit}; longest pause {totals.max_pause_s * 1e3:.2f} ms"))  # fmt: skip
    if not run.gpu_available:
        rows.append(("GPU memory", "n/a", "no CUDA device"))
    elif run.gpu_retained_bytes:
        rows.append(("GPU memory", "LEAK", f"{run.gpu_retained_bytes} B retained after reload. {run.gpu_summary}"))
    else:
        rows.append(("GPU memory", "ok", "0 B retained after reload"))
    return rows


def _print_table(run: AuditRun, rows: list[tuple[str, str, str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"refitkit audit: {run.cycles} offload/reload cycles on {run.device}")
    table.add_column("watcher")
    table.add_column("verdict")
    table.add_column("detail")
    styles = {"ok": "green", "LEAK": "bold red", "warn": "yellow", "n/a": "dim"}
    for watcher, verdict, detail in rows:
        table.add_row(watcher, f"[{styles[verdict]}]{verdict}[/]", detail)
    Console(file=sys.stdout, width=160).print(table)


def _plot(run: AuditRun, path: str) -> None:
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``refitkit audit``; returns 0 when every watcher is clean, 1 on a leak."""
    parser = argparse.ArgumentParser(prog="refitkit audit", description=__doc__)
    parser.add_argument("--cycles", type=int, default=30, help="watched offload/reload cycles (default 30)")
    parser.add_argument("--width", type=int, default=512, help="demo model width (4 square layers)")
    parser.add_argument("--window", type=int, default=20, help="RSS trend window in cycles")
    parser.add_argument("--warmup", type=int, default=5, help="cycles before the RSS trend is judged")
    parser.add_argument("--threshold-mib-per-cycle", type=float, default=1.0, help="RSS growth that counts as a leak")
    parser.add_argument("--plant", choices=("none", "cycle", "bytes"), default="none",
                        help="plant a 1 MiB/cycle leak to see what a finding looks like")  # fmt: skip
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of host RSS and GPU memory per phase")
    parser.add_argument("--memory-history", metavar="PATH", help="(CUDA) record allocator history for the last cycle and dump it here")
    args = parser.parse_args(argv)
    if args.cycles < 1:
        parser.error("--cycles must be >= 1")
    run = run_audit(
        cycles=args.cycles, width=args.width, plant=args.plant, window=args.window, warmup=args.warmup,
        threshold_mib_per_cycle=args.threshold_mib_per_cycle, memory_history=args.memory_history,
    )  # fmt: skip
    rows = _verdict_rows(run)
    _print_table(run, rows)
    if args.plot:
        _plot(run, args.plot)
        print(f"plot written to {args.plot}")
    return 1 if any(verdict == "LEAK" for _, verdict, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
