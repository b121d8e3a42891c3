"""`refitkit demo | bench | audit`: the terminal front end (the only module that prints)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refitkit.audit import AuditRun

MIB = 1 << 20



def _table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is an extra; plain text is enough
        print(title)
        print("  ".join(columns))
        for row in rows:
            print("  ".join(row))
        return
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right" if column != columns[0] else "left")
    for row in rows:
        table.add_row(*row)
    Console().print(table)


def demo(args: argparse.Namespace) -> int:
    """The refit cycle end to end: train, stream weights to a spawned peer, offload, barrier, reload."""
    from refitkit.demo import run_demo

    result = run_demo(rounds=args.rounds, device=args.device)
    rows: list[list[str]] = []
    for index, round_ in enumerate(result.rounds):
        for phase in round_.refit.phases + round_.resume.phases:
            rows.append([
                f"round {index} {phase.name}", f"{phase.bytes / 2**20:.1f}", f"{phase.seconds * 1e3:.2f}",
                f"{phase.gbps:.2f}" if phase.bytes else "",
            ])
    _table(
        f"refitkit demo on {result.device} ({result.transport} transport, spawned inference peer)",
        ["phase", "MiB", "ms", "GB/s"],
        rows,
    )
    for index, round_ in enumerate(result.rounds):
        print(
            f"round {index}: loss {round_.loss:.6f}; peer weights bit-identical: {round_.peer_matches}; "
            f"trainer device storages freed while offloaded: {round_.freed_while_offloaded}"
        )
    print(
        f"host arena {result.arena_bytes / 2**20:.1f} MiB (pinned={result.arena_pinned}), allocated once; "
        f"RSS watchdog: {result.watchdog_status}; explicit collections: {result.explicit_gc}"
    )
    ok = all(r.peer_matches and r.freed_while_offloaded for r in result.rounds) and result.explicit_gc == 0
    return 0 if ok else 1


def bench(args: argparse.Namespace) -> int:
    """Run every script in benchmarks/ (source checkout); each prints its figures and same-run limits."""
    root = Path(__file__).resolve().parent.parent / "benchmarks"
    scripts = sorted(p for p in root.glob("*.py") if not p.name.startswith(("_", "limits")))
    if not scripts:
        print("no benchmarks/ folder next to the package: run from a source checkout")
        return 1
    status = 0
    for script in scripts:
        print(f"== {script.name}")
        status |= subprocess.run([sys.executable, str(script)], check=False).returncode
    return status


def _audit_rows(run: "AuditRun") -> list[tuple[str, str, str]]:
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


def _print_audit_table(run: "AuditRun", rows: list[tuple[str, str, str]]) -> None:
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


def audit(argv: list[str] | None = None) -> int:
    """Entry point of ``refitkit audit``; returns 0 when every watcher is clean, 1 on a leak."""
    parser = argparse.ArgumentParser(prog="refitkit audit", description="run offload/reload cycles on a demo model under all four watchers; print a verdict table")
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
    from refitkit.audit import plot_audit, run_audit

    run = run_audit(
        cycles=args.cycles, width=args.width, plant=args.plant, window=args.window, warmup=args.warmup,
        threshold_mib_per_cycle=args.threshold_mib_per_cycle, memory_history=args.memory_history,
    )  # fmt: skip
    rows = _audit_rows(run)
    _print_audit_table(run, rows)
    if args.plot:
        plot_audit(run, args.plot)
        print(f"plot written to {args.plot}")
    return 1 if any(verdict == "LEAK" for _, verdict, _ in rows) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["audit"]:
        return audit(argv[1:])
    parser = argparse.ArgumentParser(prog="refitkit", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="the refit cycle end to end on a small model")
    demo_parser.add_argument("--rounds", type=int, default=3)
    demo_parser.add_argument("--device", default=None)
    commands.add_parser("bench", help="run benchmarks/ (GPU figures against same-run limits)")
    commands.add_parser("audit", help="watchdog verdicts over N cycles (see `refitkit audit --help`)")
    args = parser.parse_args(argv)
    return {"demo": demo, "bench": bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
