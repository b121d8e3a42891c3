"""`refitkit demo | bench | audit`: the terminal front end (the only module that prints)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path



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
        f"RSS watchdog: {result.watchdog_status}; explicit gc.collect() calls: {result.explicit_gc}"
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


def audit(argv: list[str]) -> int:
    from refitkit.audit import main as audit_main

    return audit_main(argv)


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
