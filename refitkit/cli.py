"""`refitkit demo | bench | audit`: the terminal front end (the only module that prints)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

from refitkit.offload import (
    HostArena,
    MoveStats,
    flush_device,
    offload_grads,
    offload_optimizer,
    offload_tensors,
    reload_grads,
    reload_optimizer,
    reload_tensors,
)


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


def _stats_row(phase: str, stats: MoveStats) -> list[str]:
    return [phase, f"{stats.bytes / 2**20:.1f}", str(stats.storages), f"{stats.seconds * 1e3:.2f}", f"{stats.gbps:.2f}"]


def _demo_model(device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)]
    model = torch.nn.Sequential(*layers).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, device: torch.device) -> float:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(16, 512, generator=generator).to(device)
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    return loss.item()


def demo(args: argparse.Namespace) -> int:
    """Train, offload params + grads + AdamW state into a HostArena, reload, train on: show what moved."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, optimizer = _demo_model(device)
    params = list(model.named_parameters())
    arena = HostArena()
    rows: list[list[str]] = []
    for round_index in range(args.rounds):
        loss = _train_step(model, optimizer, round_index, device)
        grads = offload_grads(params, arena, keep=True)
        weights = offload_tensors(params, arena)
        states = offload_optimizer(optimizer, arena)
        flush_device(device)
        freed = all(p.untyped_storage().nbytes() == 0 for _, p in params)
        rows += [
            _stats_row(f"round {round_index} offload params", weights),
            _stats_row(f"round {round_index} offload grads", grads),
            _stats_row(f"round {round_index} offload optimizer", states),
        ]
        rows.append(_stats_row(f"round {round_index} reload params", reload_tensors(params, arena)))
        rows.append(_stats_row(f"round {round_index} reload optimizer", reload_optimizer(optimizer, arena)))
        reload_grads(params, arena, zero=True)
        optimizer.zero_grad(set_to_none=True)
        print(f"round {round_index}: loss {loss:.5f}; device storages freed while offloaded: {freed}")
    _table(
        f"refitkit demo on {device}: host arena {arena.nbytes / 2**20:.1f} MiB (pinned={arena.pinned}), "
        f"allocated once for {args.rounds} rounds",
        ["phase", "MiB", "storages", "ms", "GB/s"],
        rows,
    )
    return 0


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
    demo_parser = commands.add_parser("demo", help="offload/reload rounds on a small model")
    demo_parser.add_argument("--rounds", type=int, default=3)
    demo_parser.add_argument("--device", default=None)
    commands.add_parser("bench", help="run benchmarks/ (GPU figures against same-run limits)")
    commands.add_parser("audit", help="watchdog verdicts over N cycles (see `refitkit audit --help`)")
    args = parser.parse_args(argv)
    return {"demo": demo, "bench": bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
