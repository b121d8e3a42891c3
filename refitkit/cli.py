"""`refitkit demo | bench | audit`: the terminal front end (the only module that prints).

Bad options end in one argparse-style line (``refitkit audit: error: ...``) and exit status 2;
a refitkit error while a command runs ends in one such line and status 1.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from refitkit.errors import RefitError

if TYPE_CHECKING:
    from refitkit.audit import AuditRun

MIB = 1 << 20
GIB = 1 << 30
AUDIT_BYTES_PER_PARAM = 40  # param, grad, two AdamW states and their arena copies, with margin
AUDIT_BASE_BYTES = 512 * MIB


Run = Callable[[argparse.Namespace, argparse.ArgumentParser], int]


def _version() -> str:
    """The installed distribution's version; the package's own when run from an uninstalled checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("refitkit")
    except PackageNotFoundError:
        from refitkit import __version__

        return __version__


def _int_at_least(minimum: int, why: str = "") -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}{why}, got {value}")
        return value

    return parse


def _finite_float(*, allow_zero: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>=' if allow_zero else '>'} 0, got {text!r}")
        return value

    return parse


def _check_output_path(parser: argparse.ArgumentParser, option: str, path: str) -> None:
    """Fail before the run, not after it: the file's folder must exist and be writable."""
    try:
        target = Path(path).expanduser().resolve()
        if target.is_dir():
            parser.error(f"{option} {path}: is a folder; give a file name")
        folder = target.parent
        if not folder.is_dir():
            parser.error(f"{option} {path}: folder {folder} does not exist")
        if not os.access(folder, os.W_OK):
            parser.error(f"{option} {path}: folder {folder} is not writable")
    except (OSError, RuntimeError) as error:  # a name too long, a symlink loop
        parser.error(
            f"{option} {path}: not a usable path ({error.__class__.__name__}: {error.strerror if isinstance(error, OSError) else error})"
        )


def _check_cuda_device(parser: argparse.ArgumentParser, text: str) -> None:
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        parser.error(f"--device {text!r}: not a device (expected cpu, cuda or cuda:N)")
    if device.type == "cpu":
        return
    if device.type != "cuda":
        parser.error(f"--device {text}: the demo runs on cpu or cuda")
    if not torch.cuda.is_available():
        parser.error(f"--device {text}: CUDA is not available here (torch {torch.__version__}); use --device cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        parser.error(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")


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


def demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The refit cycle end to end: train, stream weights to a spawned peer, offload, barrier, reload."""
    if args.device is not None:
        _check_cuda_device(parser, args.device)
    from refitkit.demo import run_demo

    result = run_demo(rounds=args.rounds, device=args.device)
    rows: list[list[str]] = []
    for index, round_ in enumerate(result.rounds):
        for phase in round_.refit.phases + round_.resume.phases:
            rows.append(
                [
                    f"round {index} {phase.name}",
                    f"{phase.bytes / 2**20:.1f}",
                    f"{phase.seconds * 1e3:.2f}",
                    f"{phase.gbps:.2f}" if phase.bytes else "",
                ]
            )
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


def bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run benchmarks/ (source checkout), each sized to this machine's memory or skipped with the reason."""
    root = Path(__file__).resolve().parent.parent
    folder = root / "benchmarks"
    if not (folder / "_sizing.py").is_file():  # benchmarks/ is not part of the wheel
        print(
            f"{parser.prog}: error: benchmarks run from a source checkout, not from an installed package "
            f"(no benchmarks/ beside {root}): in a clone of the repository, run `make bench`, "
            "or `refitkit bench` with refitkit installed from it by `pip install -e .`",
            file=sys.stderr,
        )
        return 1
    sys.path.insert(0, str(root))  # benchmarks/ belongs to the source checkout, not to the installed library
    from benchmarks._sizing import PLANNERS, available_host_bytes, plan_benchmarks, probe_machine

    names = sorted({name.removesuffix(".py") for chosen in args.only or [] for name in chosen.split(",") if name})
    unknown = [name for name in names if name not in PLANNERS]
    if unknown:
        parser.error(f"--only {','.join(unknown)}: no such benchmark (choose from {', '.join(sorted(PLANNERS))})")
    host_bytes = None if args.host_memory_gib is None else int(args.host_memory_gib * GIB)
    gpu_bytes = None if args.gpu_memory_gib is None else int(args.gpu_memory_gib * GIB)
    machine = probe_machine(host_bytes=host_bytes, gpu_bytes=gpu_bytes)
    available = available_host_bytes()
    print(
        f"budget: {machine.host_bytes / GIB:.1f} GiB host ({available / GIB:.1f} GiB available), "
        f"{machine.gpu_bytes / GIB:.1f} GiB GPU" + ("" if machine.has_gpu else " (no GPU: GPU benchmarks skipped)")
    )
    if machine.host_bytes > available:
        print(f"note: --host-memory-gib {args.host_memory_gib:g} is more than the host has available now")
    unplanned = sorted(
        p.name for p in folder.glob("*.py") if not p.name.startswith(("_", "limits")) and p.stem not in PLANNERS
    )
    plans = plan_benchmarks(machine, names or None)
    failed: list[str] = []
    for plan in plans:
        if not plan.runs:
            print(f"== {plan.script}: skipped ({plan.skip})")
            continue
        print(f"== {' '.join((plan.script, *plan.args))}  [{plan.note}]", flush=True)
        if args.dry_run:
            continue
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(root), os.environ.get("PYTHONPATH")))))
        if subprocess.run([sys.executable, str(folder / plan.script), *plan.args], env=env, check=False).returncode:
            failed.append(plan.script)
    for name in [] if names else unplanned:
        print(f"== {name}: skipped (no size plan in benchmarks/_sizing.py: run it by hand)")
    if failed:
        print(f"{parser.prog}: error: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _audit_rows(run: AuditRun) -> list[tuple[str, str, str]]:
    rows = []
    last = run.verdicts[-1]
    flagged = [v for v in run.verdicts if v.leaking]
    if flagged:
        first = flagged[0]
        rows.append(
            (
                "host RSS",
                "LEAK",
                f"growing from cycle {first.cycle}: {last.slope_mib_per_cycle:+.2f} MiB/cycle, phase {first.phase!r}",
            )
        )
    else:
        rows.append(
            (
                "host RSS",
                "ok",
                f"{last.slope_mib_per_cycle:+.2f} MiB/cycle over {last.window} cycles; RSS {last.rss_bytes / MIB:.0f} MiB",
            )
        )
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
        rows.append(
            (
                "GC activity",
                status,
                f"automatic by generation {gens}, {totals.automatic_s * 1e3:.1f} ms; "
                f"explicit {totals.explicit}; longest pause {totals.max_pause_s * 1e3:.2f} ms",
            )
        )
    if not run.gpu_available:
        rows.append(("GPU memory", "n/a", "no CUDA device"))
    elif run.gpu_retained_bytes:
        rows.append(("GPU memory", "LEAK", f"{run.gpu_retained_bytes} B retained after reload. {run.gpu_summary}"))
    else:
        rows.append(("GPU memory", "ok", "0 B retained after reload"))
    return rows


def _print_audit_table(run: AuditRun, rows: list[tuple[str, str, str]]) -> None:
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


def _check_audit_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """What argparse's types cannot see: the machine (memory, CUDA, matplotlib) and the output folders."""
    import psutil
    import torch

    if args.cycles < args.warmup + 3:  # the trend starts after the warm-up and needs 3 points: else nothing is judged
        parser.error(
            f"--cycles {args.cycles} leaves no cycle to judge after --warmup {args.warmup}: "
            f"need --cycles >= {args.warmup + 3} (or a smaller --warmup)"
        )
    params = 4 * (args.width * args.width + args.width)
    need = AUDIT_BASE_BYTES + AUDIT_BYTES_PER_PARAM * params
    available = psutil.virtual_memory().available
    if need > available:
        parser.error(
            f"--width {args.width}: the demo model needs ~{need / GIB:.1f} GiB, "
            f"{available / GIB:.1f} GiB is available; use a smaller --width"
        )
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install refitkit[plot]")
        _check_output_path(parser, "--plot", args.plot)
    if args.memory_history:
        if not torch.cuda.is_available():
            parser.error("--memory-history records the CUDA allocator: no CUDA device here")
        _check_output_path(parser, "--memory-history", args.memory_history)


def run_audit_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``refitkit audit``: 0 when every watcher is clean, 1 on a leak."""
    _check_audit_options(args, parser)
    from refitkit.audit import plot_audit, run_audit

    run = run_audit(
        cycles=args.cycles,
        width=args.width,
        plant=args.plant,
        window=args.window,
        warmup=args.warmup,
        threshold_mib_per_cycle=args.threshold_mib_per_cycle,
        memory_history=args.memory_history,
    )
    rows = _audit_rows(run)
    _print_audit_table(run, rows)
    if args.plot:
        try:
            plot_audit(run, args.plot)
        except OSError as error:
            raise RefitError(f"cannot write the plot to {args.plot}: {error}") from error
        print(f"plot written to {args.plot}")
    return 1 if any(verdict == "LEAK" for _, verdict, _ in rows) else 0


def _add_audit_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cycles", type=_int_at_least(1), default=30, help="watched offload/reload cycles (default 30)"
    )
    parser.add_argument(
        "--width", type=_int_at_least(1), default=512, help="demo model width: 4 square layers (default 512)"
    )
    parser.add_argument(
        "--window",
        type=_int_at_least(3, " (a trend needs 3 cycles)"),
        default=20,
        help="RSS trend window in cycles, >= 3 (default 20)",
    )
    parser.add_argument(
        "--warmup", type=_int_at_least(0), default=5, help="cycles before the RSS trend is judged (default 5)"
    )
    parser.add_argument(
        "--threshold-mib-per-cycle",
        type=_finite_float(allow_zero=False),
        default=1.0,
        help="RSS growth that counts as a leak, MiB per cycle (default 1.0)",
    )
    parser.add_argument(
        "--plant",
        choices=("none", "cycle", "bytes"),
        default="none",
        help="plant a leak (cycle: 1 MiB held by a reference cycle; bytes: 4 MiB of RSS) per cycle "
        "to see what a finding looks like (default none)",
    )
    parser.add_argument(
        "--plot", metavar="PATH", help="write a PNG of host RSS and GPU memory per phase (needs matplotlib)"
    )
    parser.add_argument(
        "--memory-history", metavar="PATH", help="(CUDA) record allocator history for the last cycle and dump it here"
    )


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: ``refitkit [--version] {demo,bench,audit} ...``."""
    parser = argparse.ArgumentParser(
        prog="refitkit",
        description="colocated RL refit: weights to the inference engine, trainer state to pinned host memory",
    )
    parser.add_argument("--version", action="version", version=f"refitkit {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench,audit}")

    demo_parser = commands.add_parser(
        "demo",
        help="the refit cycle end to end on a small model",
        description="train, stream weights to a spawned peer, offload, line up, reload",
    )
    demo_parser.add_argument("--rounds", type=_int_at_least(1), default=3, help="train/refit/resume rounds (default 3)")
    demo_parser.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)"
    )
    demo_parser.set_defaults(run=demo, parser=demo_parser)

    bench_parser = commands.add_parser(
        "bench",
        help="run benchmarks/, sized to this machine",
        description="run each script in benchmarks/ at the largest size this machine's "
        "memory allows, or skip it with the reason. benchmarks/ ships with the source "
        "checkout, not the wheel: run it from a clone (make bench, or after pip install -e .); "
        "exits 1 outside a source checkout, and when a benchmark fails",
    )
    bench_parser.add_argument(
        "--only", action="append", metavar="NAME[,NAME]", help="run only these benchmarks (e.g. fsdp_offload)"
    )
    bench_parser.add_argument(
        "--host-memory-gib",
        type=_finite_float(allow_zero=False),
        default=None,
        help="host memory the benchmarks may use (default: 80%% of what psutil reports available)",
    )
    bench_parser.add_argument(
        "--gpu-memory-gib",
        type=_finite_float(allow_zero=True),
        default=None,
        help="GPU memory they may use; 0 skips GPU benchmarks (default: 90%% of GPU 0's free memory)",
    )
    bench_parser.add_argument(
        "--dry-run", action="store_true", help="print the plan (sizes and skips) without running anything"
    )
    bench_parser.set_defaults(run=bench, parser=bench_parser)

    audit_parser = commands.add_parser(
        "audit",
        help="watchdog verdicts over N offload/reload cycles",
        description="run offload/reload cycles on a demo model under all four watchers; print a verdict table",
    )
    _add_audit_options(audit_parser)
    audit_parser.set_defaults(run=run_audit_command, parser=audit_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    run: Run = args.run
    try:
        return run(args, args.parser)
    except RefitError as error:
        message = " ".join(str(error).split())  # one line, whatever the library's message looks like
        print(f"{args.parser.prog}: error: {type(error).__name__}: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{args.parser.prog}: interrupted", file=sys.stderr)
        return 130


def audit(argv: list[str] | None = None) -> int:
    """``refitkit audit`` with its own arguments (what ``main(["audit", *argv])`` does)."""
    return main(["audit", *(argv or [])])


if __name__ == "__main__":
    sys.exit(main())
