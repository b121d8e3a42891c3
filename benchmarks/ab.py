"""Same-run A/B on one GPU machine: refitkit before (a saved copy of its package) against after (this checkout).

Each benchmark runs as a subprocess, before / after / before / after ... (``--pairs``; ``--order abba`` flips every
second pair), each subprocess seeing only its own ``refitkit``. The after side runs this checkout's scripts; the
before side runs copies of the same ``benchmarks/`` beside a copy of the before package (``--before DIR``, made by
``benchmarks/ab_prepare.sh``) in a temporary directory. That directory, or the checkout, comes first on
``PYTHONPATH``, which vLLM's spawned processes inherit, and vLLM's ``general_plugins`` entry point imports
``refitkit.rollout.vllm`` by name, so it too finds the side's package. Both sides get the same arguments: only
refitkit differs. A check before the first run imports each side's refitkit and stops if it resolves elsewhere.

Benchmarks (``--only``; the colocated ones selected together run in one process per side and pair):

    weight-sync-8b   weight_sync.py --models 8b --paths direct --layout segments --loaders per-tensor --sources held
                     the sync into a receiver process that copies: median of the steady rounds
    colocated-8b     colocated_loop.py --models 8b: the sync alone into the serving GPU vLLM (its --pushes, the
                     first left out) and the refit (its steps' whole refit, step 0 left out)
    colocated-0.6b   the same with Qwen3-0.6B shapes

A run's figure is the median of its steady samples; a side's figure the median of its runs' figures; the ratio is
after / before; the drift is the spread of one side's runs, (max - min) / median. The table and every run's output
go to ``--out``: ``ab.txt`` (the table), ``ab.json`` (runs, samples, the table; rewritten after every run) and
``ab.log`` (the subprocesses' output). ``--budget-s`` starts a pair of runs only if it is estimated to end inside
the budget; what is left is named at the end, for another call with ``--resume`` of this call's ``ab.json``.

    VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_USE_FLASHINFER_SAMPLER=0 \\
        python benchmarks/ab.py --before ab/before --pairs 3 --out "$OUT" --budget-s 540
    python benchmarks/ab.py --report ab-1.json ab-2.json     # one table from several calls (no GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHECKOUT = Path(__file__).resolve().parent.parent
SIDES = ("before", "after")
GATE_RATIO = 1.05  # issue 46: after's median <= 1.05x before's
GROUPS: dict[str, tuple[str, ...]] = {  # one subprocess per group, side and pair
    "weight-sync": ("weight-sync-8b",),
    "colocated": ("colocated-0.6b", "colocated-8b"),
}
BENCHMARKS = [name for names in GROUPS.values() for name in names]
# Guessed seconds per run on one H100/H200, not measured: replaced by the measured time of the same run kind once
# one ran in this call. Colocated: imports and engine starts dominate; 8B pins a 49 GB host arena on its first refit.
GUESS_S = {"weight-sync-8b": 35.0, "colocated-0.6b": 45.0, "colocated-8b": 110.0}
GUESS_GROUP_S = {"weight-sync": 0.0, "colocated": 15.0}  # a process's imports, once per process
CHECKPOINT_WRITE_S = {"colocated-0.6b": 5.0, "colocated-8b": 60.0}  # the first colocated run writes the checkpoint
PREFLIGHT = """
import json, importlib.metadata as md
from pathlib import Path
import refitkit, refitkit.rollout.vllm, refitkit.transfer, refitkit.engines.fsdp
plugins = [e.value for e in md.entry_points(group="vllm.general_plugins") if e.value.startswith("refitkit.")]
print(json.dumps({"refitkit": str(Path(refitkit.__file__).resolve().parent), "vllm_plugins": plugins}))
"""


@dataclass(frozen=True)
class Figure:
    """One row of the table: a benchmark's figure, read from its runs' JSON."""

    benchmark: str
    name: str
    unit: str
    gated: bool  # held to GATE_RATIO by issue 46's "Done means"

    @property
    def key(self) -> str:
        return f"{self.benchmark} {self.name}"


FIGURES = [
    Figure("weight-sync-8b", "sync", "ms", gated=True),
    Figure("colocated-8b", "sync alone", "ms", gated=True),
    Figure("colocated-8b", "refit", "ms", gated=True),
    Figure("colocated-8b", "refit / flat D2H", "x", gated=False),
    Figure("colocated-8b", "sync in the refit", "ms", gated=False),
    Figure("colocated-0.6b", "sync alone", "ms", gated=True),
    Figure("colocated-0.6b", "refit", "ms", gated=False),
]


@dataclass(frozen=True)
class Planned:
    """One subprocess: a group's selected benchmarks on one side in one pair."""

    group: str
    benchmarks: tuple[str, ...]
    side: str
    pair: int

    @property
    def label(self) -> str:
        return f"{'+'.join(self.benchmarks)} {self.side} pair {self.pair}"


# -- reading a run's JSON ---------------------------------------------------------------------------------------


def weight_sync_samples(raw: dict, benchmark: str) -> tuple[dict[str, list[float]], list[str]]:
    """The steady rounds of the 8B row, and what makes them unusable."""
    rows = [row for row in raw.get("rows", []) if row.get("model") == "8b"]
    if not rows:
        return {}, ["no 8b row in its JSON"]
    row = rows[0]
    problems = [] if row.get("intact") else ["the receiver's weights differ from the sender's"]
    return {f"{benchmark} sync": list(row["steady_ms"])}, problems


def colocated_samples(raw: list, benchmark: str) -> tuple[dict[str, list[float]], list[str]]:
    """The pushes after the first and the refits after step 0 of one model, and what makes them unusable."""
    model = benchmark.removeprefix("colocated-")
    result = next((result for result in raw if result.get("model") == model), None)
    if result is None:
        return {}, [f"no {model} result in its JSON"]
    problems = []
    if not all(row.get("params_equal") for row in result["rows"]):
        problems.append("engine params differ from the trainer's after a refit")
    if not result["pushes"] or result["pushes"][-1].get("params_equal") is not True:
        problems.append("engine params differ from the trainer's after the last push (or no pushes)")
    steady = [row for row in result["rows"][1:] if not row.get("traced")]
    return {
        f"{benchmark} sync alone": [push["sync_ms"] for push in result["pushes"][1:] if not push.get("profiled")],
        f"{benchmark} refit": [row["refit_ms"] for row in steady],
        f"{benchmark} refit / flat D2H": [row["refit_vs_flat_d2h"] for row in steady],
        f"{benchmark} sync in the refit": [row["sync_weights_ms"] for row in steady if "sync_weights_ms" in row],
    }, problems


READERS: dict[str, Callable[[Any, str], tuple[dict[str, list[float]], list[str]]]] = {
    "weight-sync": weight_sync_samples,
    "colocated": colocated_samples,
}


def refitkit_of(raw: Any) -> list[str]:
    """The refitkit package directories a run's JSON says it imported."""
    results = raw if isinstance(raw, list) else [raw]
    return sorted({result["refitkit"] for result in results if isinstance(result, dict) and "refitkit" in result})


# -- running ----------------------------------------------------------------------------------------------------


def stage_before(before: Path, after: Path) -> Path:
    """A temporary root holding the before package and a copy of the after side's benchmarks/ (copies, not links:
    the scripts put ``Path(__file__).resolve().parent.parent`` first on sys.path)."""
    root = Path(tempfile.mkdtemp(prefix="refitkit-ab-before-"))
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(before / "refitkit", root / "refitkit", ignore=skip)
    shutil.copytree(after / "benchmarks", root / "benchmarks", ignore=skip)
    return root


def side_env(root: Path) -> dict[str, str]:
    """The environment of one side's subprocesses: its root first on PYTHONPATH (vLLM's processes inherit it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the benchmark uses CUDA before vLLM starts
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def command(run: Planned, root: Path, json_path: Path, args: argparse.Namespace) -> list[str]:
    """The subprocess's command line: the same on both sides but for ``root``."""
    if run.group == "weight-sync":
        return [
            sys.executable,
            str(root / "benchmarks" / "weight_sync.py"),
            *("--models", "8b", "--paths", "direct", "--layout", "segments"),
            *("--loaders", "per-tensor", "--sources", "held", "--rounds", str(args.sync_rounds)),
            *("--json", str(json_path)),
        ]
    models = ",".join(benchmark.removeprefix("colocated-") for benchmark in run.benchmarks)
    return [
        sys.executable,
        str(root / "benchmarks" / "colocated_loop.py"),
        *("--models", models, "--steps", str(args.steps), "--pushes", str(args.pushes), "--push-paths", "direct"),
        *("--optimizer", args.optimizer, *(["--zero-grads"] if args.zero_grads else [])),
        *("--checkpoint", args.checkpoint_dir, "--json", str(json_path)),
        *(["--profile", str(json_path.parent / "profile")] if args.profile else []),
        *(["--pin-cpus"] if args.pin_cpus else []),
    ]


def preflight(roots: dict[str, Path], dry_run: bool) -> dict[str, dict]:
    """Import each side's refitkit as its subprocesses will; stop if one resolves outside its root."""
    found = {}
    for side, root in roots.items():
        done = subprocess.run(
            [sys.executable, "-c", PREFLIGHT], env=side_env(root), cwd=root, capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            raise SystemExit(f"[ab] {side}: importing refitkit from {root} failed:\n{done.stderr[-3000:]}")
        found[side] = json.loads(done.stdout.strip().splitlines()[-1])
        wanted = str((root / "refitkit").resolve())
        if found[side]["refitkit"] != wanted:
            raise SystemExit(f"[ab] {side}: refitkit resolves to {found[side]['refitkit']}, not {wanted}")
        print(f"[ab] {side}: refitkit from {found[side]['refitkit']}", flush=True)
        if not found[side]["vllm_plugins"] and not dry_run:
            print(
                "[ab] warning: no refitkit vllm.general_plugins entry point is installed "
                "(pip install --no-deps --target /tmp/site .): vLLM will not load refitkit's plugin",
                flush=True,
            )
    return found


def gpu_memory_used_mib() -> int | None:
    """Device 0's used memory by nvidia-smi (no CUDA context in this process), or None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return int(out.split()[0])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return None


def wait_for_idle_gpu(timeout_s: float = 60.0, idle_mib: int = 2048) -> int | None:
    """Wait (bounded) until the last run's processes gave the device's memory back; the used MiB at the end."""
    deadline = time.monotonic() + timeout_s
    used = gpu_memory_used_mib()
    while used is not None and used > idle_mib and time.monotonic() < deadline:
        time.sleep(2.0)  # polling another process's teardown: nothing to block on
        used = gpu_memory_used_mib()
    if used is not None and used > idle_mib:
        print(f"[ab] warning: {used} MiB still used on the GPU after {timeout_s:.0f} s; running anyway", flush=True)
    return used


def run_one(
    run: Planned, root: Path, args: argparse.Namespace, log, timeout_s: float
) -> tuple[int, float, Any, int | None]:
    """Run one subprocess (its own process group, killed whole at ``timeout_s``); rc, seconds, its JSON, used MiB."""
    used = wait_for_idle_gpu()
    with tempfile.TemporaryDirectory(prefix="refitkit-ab-run-") as scratch:
        json_path = Path(scratch) / "result.json"
        argv = command(run, root, json_path, args)
        log.write(f"\n===== {run.label}: {' '.join(argv)}\n")
        log.flush()
        began = time.monotonic()
        process = subprocess.Popen(
            argv, env=side_env(root), cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        tail: list[str] = []
        try:
            rc = pump(process, log, tail, began + timeout_s, verbose=args.verbose)
        finally:
            stop_group(process)
        seconds = time.monotonic() - began
        if rc != 0:
            print(f"[ab] {run.label} ended with rc {rc}; its last lines:\n" + "".join(tail[-30:]), flush=True)
        try:
            raw = json.loads(json_path.read_text())
        except (OSError, ValueError):  # none written, or cut off by the kill
            raw = None
        if args.profile:
            flatten_reports(Path(scratch) / "profile", Path(args.profile), run.label)
    return rc, seconds, raw, used


def flatten_reports(made: Path, into: Path, label: str) -> list[Path]:
    """Copy a run's profile reports (``made``, one folder per model) into the one flat folder ``into`` (the GPU machine
    brings back no nested folder), each as ``<run label>-<model>-<file>``; the copies."""
    copies = []
    for report in sorted(made.rglob("*.txt")) if made.is_dir() else []:
        into.mkdir(parents=True, exist_ok=True)
        copies.append(into / "-".join((label.replace(" ", "-"), *report.relative_to(made).parts)))
        shutil.copyfile(report, copies[-1])
    return copies


def pump(process: subprocess.Popen, log, tail: list[str], deadline: float, *, verbose: bool) -> int:
    """Copy the subprocess's output into the log until it exits; -9 if it outlived ``deadline``."""
    import selectors

    fd = process.stdout.fileno()
    selector = selectors.DefaultSelector()
    selector.register(fd, selectors.EVENT_READ)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            print("[ab] the run outlived its timeout: killing its process group", flush=True)
            return -9
        if not selector.select(timeout=min(left, 5.0)):
            continue
        chunk = os.read(fd, 1 << 16).decode(errors="replace")  # not readline: progress bars end no line
        if not chunk:  # end of output: the process is exiting
            try:
                return process.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return -9
        log.write(chunk)
        tail.extend(chunk.splitlines(keepends=True))
        del tail[:-60]
        if verbose:
            sys.stdout.write(chunk)


def stop_group(process: subprocess.Popen) -> None:
    """End what the run left of its process group (vLLM's engine processes too): TERM, then KILL after 15 s."""
    for sig, grace_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            continue
        try:  # the leader is gone; its children may not be
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)  # the group's last processes are exiting; killpg again below


# -- the table --------------------------------------------------------------------------------------------------


def figure_runs(runs: list[dict]) -> dict[str, dict[str, dict[int, float]]]:
    """figure key -> side -> pair -> the run's median (usable runs only; a later run of the same slot wins)."""
    out: dict[str, dict[str, dict[int, float]]] = {}
    for run in runs:
        for key, samples in run.get("samples", {}).items():
            benchmark = key.split(" ", 1)[0]
            if samples and benchmark not in run.get("unusable", {}):
                out.setdefault(key, {}).setdefault(run["side"], {})[run["pair"]] = statistics.median(samples)
    return out


def summarise(runs: list[dict]) -> list[dict]:
    """One row per figure: both sides' medians, the ratio, each pair, each side's drift."""
    by_figure = figure_runs(runs)
    rows = []
    for figure in FIGURES:
        sides = by_figure.get(figure.key)
        if not sides:
            continue
        before, after = sides.get("before", {}), sides.get("after", {})
        row: dict[str, Any] = {"figure": figure.key, "unit": figure.unit, "gated": figure.gated}
        for side, values in (("before", before), ("after", after)):
            figures = list(values.values())
            row[f"{side}_runs"] = len(figures)
            row[f"{side}_median"] = statistics.median(figures) if figures else None
            row[f"{side}_drift"] = (
                (max(figures) - min(figures)) / statistics.median(figures) if len(figures) > 1 else None
            )
        row["pairs"] = [
            {"pair": pair, "before": before[pair], "after": after[pair], "ratio": after[pair] / before[pair]}
            for pair in sorted(set(before) & set(after))
        ]
        row["ratio"] = (
            row["after_median"] / row["before_median"] if row["before_median"] and row["after_median"] else None
        )
        if figure.gated and row["ratio"] is not None:
            verdict = "ok" if row["ratio"] <= GATE_RATIO else "OVER"
            row["verdict"] = verdict if len(row["pairs"]) >= 3 else f"{verdict} ({len(row['pairs'])} of 3 pairs)"
        else:
            row["verdict"] = "—"
        rows.append(row)
    return rows


def render(rows: list[dict], runs: list[dict]) -> str:
    """The table as text: one line per figure, then each pair, then the runs that were left out and why."""
    lines = [
        f"{'figure':<36} {'before':>9} {'after':>9} {'ratio':>7} {'<=1.05x':>14} {'drift b/a':>13}  pairs (before -> after)"
    ]

    def number(value: float | None, unit: str) -> str:
        return "—" if value is None else (f"{value:.3f}" if unit == "x" else f"{value:.1f}")

    def drift(value: float | None) -> str:
        return "—" if value is None else f"{value * 100:.1f}%"

    for row in rows:
        pairs = "  ".join(
            f"{pair['pair']}: {number(pair['before'], row['unit'])}->{number(pair['after'], row['unit'])}"
            for pair in row["pairs"]
        )
        ratio = "—" if row["ratio"] is None else f"{row['ratio']:.3f}"
        lines.append(
            f"{row['figure'] + ' (' + row['unit'] + ')':<36} {number(row['before_median'], row['unit']):>9} "
            f"{number(row['after_median'], row['unit']):>9} {ratio:>7} {row['verdict']:>14} "
            f"{drift(row['before_drift']) + '/' + drift(row['after_drift']):>13}  {pairs}"
        )
    for run in runs:
        for benchmark, problems in run.get("unusable", {}).items():
            lines.append(f"left out: {benchmark} {run['side']} pair {run['pair']}: {'; '.join(problems)}")
    return "\n".join(lines)


def load_runs(paths: list[str]) -> list[dict]:
    runs = []
    for path in paths:
        runs.extend(json.loads(Path(path).read_text())["runs"])
    return runs


def done_slots(runs: list[dict]) -> set[tuple[str, str, int]]:
    """(benchmark, side, pair) slots that some run filled with usable figures."""
    return {
        (key.split(" ", 1)[0], run["side"], run["pair"])
        for run in runs
        for key, samples in run.get("samples", {}).items()
        if samples and key.split(" ", 1)[0] not in run.get("unusable", {})
    }


# -- the plan ---------------------------------------------------------------------------------------------------


def plan(args: argparse.Namespace, done: set[tuple[str, str, int]]) -> list[tuple[Planned, Planned]]:
    """Pairs of runs (before and after of one group), pair by pair, skipping slots filled by ``--resume``."""
    selected = set(args.only.split(",")) if args.only else set(BENCHMARKS)
    unknown = selected - set(BENCHMARKS)
    if unknown:
        raise SystemExit(f"--only {args.only!r}: unknown {sorted(unknown)}; choose from {', '.join(BENCHMARKS)}")
    pairs = []
    for pair in range(args.first_pair, args.pairs + 1):
        sides = SIDES if args.order == "abab" or pair % 2 == 1 else SIDES[::-1]
        for group, names in GROUPS.items():
            wanted = tuple(
                name for name in names if name in selected and not all((name, side, pair) in done for side in SIDES)
            )
            if wanted:
                first, second = (Planned(group, wanted, side, pair) for side in sides)
                pairs.append((first, second))
    return pairs


class Estimates:
    """Seconds a run should take: the last measured run of the same kind in this call, else a guess."""

    def __init__(self, checkpoint_dir: str) -> None:
        self.checkpoint_dir = Path(checkpoint_dir)
        self.measured: dict[tuple[str, ...], float] = {}

    def checkpoint_missing(self, benchmark: str) -> bool:
        model = benchmark.removeprefix("colocated-")
        return benchmark in CHECKPOINT_WRITE_S and not (self.checkpoint_dir / f"qwen3-{model}").is_dir()

    def of(self, run: Planned, *, written: frozenset[str] = frozenset()) -> float:
        """``written``: checkpoints an earlier run of the same plan writes (counted once, there)."""
        if run.benchmarks in self.measured:
            return self.measured[run.benchmarks]
        guess = GUESS_GROUP_S[run.group] + sum(GUESS_S[name] for name in run.benchmarks)
        writes = [name for name in run.benchmarks if name not in written and self.checkpoint_missing(name)]
        return guess + sum(CHECKPOINT_WRITE_S[name] for name in writes)

    def total(self, runs: list[Planned]) -> float:
        """Seconds for ``runs`` one after the other, each missing checkpoint written once."""
        seconds, written = 0.0, frozenset[str]()
        for run in runs:
            seconds += self.of(run, written=written)
            written |= set(run.benchmarks)
        return seconds

    def record(self, run: Planned, seconds: float, wrote_checkpoint: bool) -> None:
        if not wrote_checkpoint:  # a run that wrote the checkpoint says little about the next
            self.measured[run.benchmarks] = seconds


def minutes(seconds: float) -> str:
    seconds = max(0.0, seconds)
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


# -- main -------------------------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", metavar="DIR", help="a directory holding the before refitkit/ package")
    parser.add_argument("--after", metavar="DIR", default=str(CHECKOUT), help="the after checkout (default: this one)")
    parser.add_argument("--pairs", type=int, default=3, help="before/after pairs of every benchmark (default 3)")
    parser.add_argument("--first-pair", type=int, default=1, help="start at this pair (its number in the table)")
    parser.add_argument("--only", help=f"a comma list of benchmarks (default all: {','.join(BENCHMARKS)})")
    parser.add_argument("--order", choices=("abab", "abba"), default="abab", help="abba: after first in even pairs")
    parser.add_argument("--out", metavar="DIR", help="write ab.txt, ab.json and ab.log here")
    parser.add_argument("--budget-s", type=float, help="start a pair only if it is estimated to end within this")
    parser.add_argument("--run-timeout-s", type=float, default=480.0, help="kill a run (its process group) after this")
    parser.add_argument(
        "--resume", nargs="+", default=[], metavar="JSON", help="ab.json of earlier calls: skip and tabulate their runs"
    )
    parser.add_argument("--report", nargs="+", metavar="JSON", help="only print the table of these ab.json files")
    parser.add_argument("--dry-run", action="store_true", help="stage and check both sides, print the commands")
    parser.add_argument("--verbose", action="store_true", help="echo the runs' output (always in ab.log)")
    parser.add_argument(
        "--pin-cpus", action="store_true", help="colocated runs: colocated_loop --pin-cpus (both sides alike)"
    )
    parser.add_argument(
        "--profile", metavar="DIR", help="colocated runs: cProfile their last push on both sides into DIR (flat files)"
    )
    parser.add_argument(
        "--checkpoint-dir",
        default="/tmp/refitkit-ab-checkpoints",
        help="colocated_loop's --checkpoint: written once, reused by every run (8B: 16 GB)",
    )
    parser.add_argument("--steps", type=int, default=3, help="colocated_loop --steps (step 0 is left out)")
    parser.add_argument("--pushes", type=int, default=11, help="colocated_loop --pushes (the first is left out)")
    parser.add_argument("--optimizer", choices=("foreach", "fused"), default="fused", help="colocated_loop --optimizer")
    parser.add_argument("--zero-grads", action="store_true", help="colocated_loop --zero-grads (8B: H200 only)")
    parser.add_argument("--sync-rounds", type=int, default=15, help="weight_sync.py --rounds")
    args = parser.parse_args(argv)
    if args.report is None and args.before is None:
        parser.error("--before DIR is needed (or --report JSON... to print a table)")
    if not 1 <= args.first_pair <= args.pairs:
        parser.error(f"--first-pair {args.first_pair}: need 1..--pairs ({args.pairs})")
    return args


def main(argv: list[str] | None = None) -> int:
    began = time.monotonic()  # --budget-s counts from here: the staging and the import check are in the command too
    args = parse(argv)
    if args.report:
        runs = load_runs(args.report)
        print(render(summarise(runs), runs))
        return 0
    before, after = Path(args.before).resolve(), Path(args.after).resolve()
    for side, root in (("--before", before), ("--after", after)):
        if not (root / "refitkit" / "__init__.py").is_file():
            raise SystemExit(f"[ab] {side} {root}: no refitkit/ package there (benchmarks/ab_prepare.sh makes one)")
    earlier = load_runs(args.resume)
    pairs = plan(args, done_slots(earlier))
    staged = stage_before(before, after)
    try:
        roots = {"before": staged, "after": after}
        found = preflight(roots, args.dry_run)
        return execute(args, pairs, roots, found, earlier, before, began)
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def execute(
    args: argparse.Namespace,
    pairs: list[tuple[Planned, Planned]],
    roots: dict[str, Path],
    found: dict[str, dict],
    earlier: list[dict],
    before: Path,
    began: float,
) -> int:
    """Run the planned pairs (or print them, ``--dry-run``), writing ab.json after each run; 1 if a run failed."""
    estimates = Estimates(args.checkpoint_dir)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    commit_file = before / "COMMIT"
    meta = {
        "before": str(before),
        "before_commit": commit_file.read_text().strip() if commit_file.is_file() else None,
        "after": str(roots["after"]),
        "after_commit": git_head(roots["after"]),
        "gpu": gpu_name(),
        "refitkit": {side: found[side]["refitkit"] for side in found},
        "argv": sys.argv,
    }
    runs = list(earlier)
    if args.dry_run:
        for first, second in pairs:
            for run in (first, second):
                env = side_env(roots[run.side])
                argv = command(run, roots[run.side], Path("<scratch>/result.json"), args)
                print(
                    f"[ab] {run.label} (~{minutes(estimates.of(run))}): cd {roots[run.side]} && "
                    f"PYTHONPATH={env['PYTHONPATH']} VLLM_WORKER_MULTIPROC_METHOD={env['VLLM_WORKER_MULTIPROC_METHOD']} "
                    f"VLLM_USE_FLASHINFER_SAMPLER={env['VLLM_USE_FLASHINFER_SAMPLER']} {' '.join(argv)}"
                )
        total = estimates.total([run for pair in pairs for run in pair])
        print(f"[ab] {2 * len(pairs)} runs, estimated {minutes(total)} (guesses until runs are measured)")
        return 0
    left: list[str] = []
    queue = [run for pair in pairs for run in pair]
    with open(out / "ab.log", "a") if out else open(os.devnull, "w") as log:
        for index, (first, second) in enumerate(pairs):
            need = estimates.total([first, second])
            elapsed = time.monotonic() - began
            if args.budget_s is not None and elapsed + need > args.budget_s:
                left.append(f"{'+'.join(first.benchmarks)} pair {first.pair}")
                print(
                    f"[ab] skipping {'+'.join(first.benchmarks)} pair {first.pair}: ~{minutes(need)} does not fit "
                    f"the {minutes(args.budget_s - elapsed)} left of --budget-s",
                    flush=True,
                )
                continue
            for offset, run in enumerate((first, second)):
                elapsed = time.monotonic() - began
                rest = estimates.total(queue[2 * index + offset :])
                print(
                    f"[ab] {run.label}: elapsed {minutes(elapsed)}, this run ~{minutes(estimates.of(run))}, "
                    f"all left ~{minutes(rest)}",
                    flush=True,
                )
                missing = [name for name in run.benchmarks if estimates.checkpoint_missing(name)]
                timeout_s = args.run_timeout_s
                if args.budget_s is not None:  # past the budget only by what a run may overshoot its estimate
                    timeout_s = min(timeout_s, max(60.0, args.budget_s - elapsed + 60.0))
                rc, seconds, raw, used = run_one(run, roots[run.side], args, log, timeout_s)
                estimates.record(
                    run, seconds, wrote_checkpoint=any(not estimates.checkpoint_missing(n) for n in missing)
                )
                record = judge(run, roots[run.side], rc, seconds, raw, used)
                runs.append(record)
                print(f"[ab] {run.label}: {minutes(seconds)}, rc {rc}; {describe(record)}", flush=True)
                write(out, meta, runs, left=[])
    rows = summarise(runs)
    table = render(rows, runs)
    print(table, flush=True)
    if left:
        print(f"[ab] left for another call: {', '.join(left)}; run the same command with --resume <this ab.json>")
    write(out, meta, runs, left=left, table=table)
    return 0 if all(not run.get("unusable") for run in runs) else 1


def judge(run: Planned, root: Path, rc: int, seconds: float, raw: Any, used: int | None) -> dict:
    """A run's record: its samples per figure, and per benchmark why its samples cannot be used."""
    samples: dict[str, list[float]] = {}
    unusable: dict[str, list[str]] = {}
    wanted = str((root / "refitkit").resolve())
    ran = refitkit_of(raw) if raw is not None else []
    for benchmark in run.benchmarks:
        if raw is None:
            unusable[benchmark] = [f"no JSON (rc {rc})"]
            continue
        found, problems = READERS[run.group](raw, benchmark)
        if ran != [wanted]:
            problems.append(f"ran refitkit from {ran}, not {wanted}")
        samples.update(found)
        if problems:
            unusable[benchmark] = problems
    return {
        "group": run.group,
        "benchmarks": list(run.benchmarks),
        "side": run.side,
        "pair": run.pair,
        "rc": rc,
        "seconds": round(seconds, 1),
        "gpu_used_mib_before": used,
        "samples": samples,
        "unusable": unusable,
        "raw": raw,
    }


def describe(record: dict) -> str:
    """One line of a run's figures (its medians) and what made any unusable."""
    parts = [f"{key} {statistics.median(values):.2f}" for key, values in record["samples"].items() if values]
    parts += [f"UNUSABLE {name}: {', '.join(why)}" for name, why in record["unusable"].items()]
    return "; ".join(parts)


def write(out: Path | None, meta: dict, runs: list[dict], *, left: list[str], table: str | None = None) -> None:
    if out is None:
        return
    rows = summarise(runs)
    (out / "ab.json").write_text(json.dumps({"meta": meta, "table": rows, "left": left, "runs": runs}, indent=1))
    (out / "ab.txt").write_text((table or render(rows, runs)) + "\n")


def git_head(root: Path) -> str | None:
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def gpu_name() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"], capture_output=True, text=True
    )
    return done.stdout.strip() or None


if __name__ == "__main__":
    sys.exit(main())
