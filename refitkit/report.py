"""Per-phase records of refit cycles: frozen records, JSON lines, and a timeline PNG."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal gigabytes per second (0.0 when nothing moved or no time passed): every rate refitkit reports."""
    return nbytes / seconds / 1e9 if nbytes and seconds > 0 else 0.0


def repr_with_gbps(record: Any) -> str:
    """The repr of a frozen record with a ``gbps`` property: its fields, then ``gbps`` (a figure the docs list with them)."""
    shown = [f"{item.name}={getattr(record, item.name)!r}" for item in fields(record) if item.repr]
    return f"{type(record).__name__}({', '.join([*shown, f'gbps={record.gbps!r}'])})"


@dataclass(frozen=True)
class PhaseRecord:
    """One phase of a cycle: how long it took and what it moved."""

    name: str
    start_s: float  # seconds since the cycle started
    seconds: float
    bytes: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return gbps(self.bytes, self.seconds)

    __repr__ = repr_with_gbps


@dataclass(frozen=True)
class RefitReport:
    """All phases of one cycle on one rank."""

    step: int
    rank: int
    phases: tuple[PhaseRecord, ...]

    @property
    def seconds(self) -> float:
        return sum(phase.seconds for phase in self.phases)

    def phase(self, name: str) -> PhaseRecord:
        for record in self.phases:
            if record.name == name:
                return record
        raise KeyError(f"no phase {name!r} in this report; phases: {[p.name for p in self.phases]}")

    def to_json(self) -> str:
        """One JSON line (no NaNs, no objects): step, rank, and each phase with its GB/s."""
        phases = [{**asdict(p), "gbps": p.gbps} for p in self.phases]
        return json.dumps({"step": self.step, "rank": self.rank, "seconds": self.seconds, "phases": phases})


def write_jsonl(reports: Iterable[RefitReport], path: str | Path) -> None:
    """Append reports to a JSON-lines file."""
    with open(path, "a", encoding="utf-8") as handle:
        for report in reports:
            handle.write(report.to_json() + "\n")


def plot_timeline(reports: list[RefitReport], path: str | Path) -> None:
    """A PNG with one row per cycle and one coloured bar per phase (needs the `plot` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # optional extra
        raise ImportError("plot_timeline needs matplotlib: pip install 'refitkit[plot]'") from exc
    names = sorted(
        {p.name for r in reports for p in r.phases}, key=lambda n: [p.name for r in reports for p in r.phases].index(n)
    )
    colours = {name: plt.cm.tab10(i % 10) for i, name in enumerate(names)}
    figure, axes = plt.subplots(figsize=(10, 1 + 0.4 * len(reports)))
    for row, report in enumerate(reports):
        for phase in report.phases:
            axes.barh(row, phase.seconds * 1e3, left=phase.start_s * 1e3, color=colours[phase.name])
    axes.set_yticks(range(len(reports)), [f"step {r.step} rank {r.rank}" for r in reports])
    axes.set_xlabel("ms since cycle start")
    axes.legend(
        handles=[plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in names],
        labels=names,
        loc="upper right",
        fontsize="small",
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
