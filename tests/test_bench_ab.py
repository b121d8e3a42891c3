"""benchmarks/ab.py on CPU: the before side is staged and imported apart from the after side, both sides get the same
command, and the table reads the benchmarks' JSON as they write it. The runs themselves need the GPU machine."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import ab  # noqa: E402


def test_dry_run_stages_the_before_package_apart_and_gives_both_sides_the_same_command(tmp_path):
    before = tmp_path / "before"
    shutil.copytree(ROOT / "refitkit", before / "refitkit", ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    done = subprocess.run(
        [sys.executable, "benchmarks/ab.py", "--before", str(before), "--dry-run", "--only", "weight-sync-8b"],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    staged = re.search(r"\[ab\] before: refitkit from (\S+)/refitkit\n", done.stdout)
    assert staged and Path(staged.group(1)).name.startswith("refitkit-ab-before-"), done.stdout
    assert f"[ab] after: refitkit from {ROOT / 'refitkit'}\n" in done.stdout
    assert not Path(staged.group(1)).exists()  # removed when the call ends
    commands = re.findall(r"\[ab\] weight-sync-8b (before|after) pair (\d) \(~[^)]*\): cd (\S+) && (.*)", done.stdout)
    assert [(side, int(pair)) for side, pair, _, _ in commands] == [
        (side, pair) for pair in (1, 2, 3) for side in ("before", "after")
    ]
    for side, _, root, line in commands:
        assert root == (staged.group(1) if side == "before" else str(ROOT))
        assert line.startswith(f"PYTHONPATH={root}{os.pathsep}")  # the side's root first: vLLM's processes inherit it
        after_env = line.split(" ", 1)[1]  # the rest of PYTHONPATH is this process's
        # only the side's scripts differ (this interpreter may itself live under the checkout: a .venv in it)
        scripts, first_scripts = f"{root}/benchmarks/", f"{commands[0][2]}/benchmarks/"
        assert after_env.replace(scripts, "<root>/benchmarks/") == commands[0][3].split(" ", 1)[1].replace(
            first_scripts, "<root>/benchmarks/"
        )
    assert "[ab] 6 runs, estimated " in done.stdout


def colocated(model: str, sync_ms: float, refit_ms: float, *, equal: bool = True) -> dict:
    """A model's result as benchmarks/colocated_loop.py writes it (the fields the table reads)."""
    rows = [
        {"refit_ms": refit_ms + step, "refit_vs_flat_d2h": 1.1, "sync_weights_ms": 40.0, "params_equal": equal}
        for step in range(3)
    ]
    pushes = [{"sync_ms": sync_ms * (3 if push == 0 else 1), "params_equal": None} for push in range(5)]
    pushes[-1]["params_equal"] = True
    return {"model": model, "rows": rows, "pushes": pushes, "refitkit": "/side/refitkit"}


def test_the_table_holds_medians_ratio_pairs_and_drift_and_leaves_out_what_failed():
    runs = []
    for pair, (before_ms, after_ms) in enumerate(((20.0, 21.0), (22.0, 22.0), (24.0, 26.0)), start=1):
        for side, sync_ms in (("before", before_ms), ("after", after_ms)):
            run = ab.Planned("colocated", ("colocated-8b",), side, pair)
            runs.append(ab.judge(run, Path("/side"), 0, 100.0, [colocated("8b", sync_ms, 900.0)], None))
    broken = ab.Planned("colocated", ("colocated-8b",), "after", 4)
    runs.append(ab.judge(broken, Path("/side"), 0, 100.0, [colocated("8b", 1.0, 1.0, equal=False)], None))
    elsewhere = ab.Planned("colocated", ("colocated-8b",), "before", 4)
    runs.append(ab.judge(elsewhere, Path("/other"), 0, 100.0, [colocated("8b", 1.0, 1.0)], None))

    rows = {row["figure"]: row for row in ab.summarise(runs)}
    sync = rows["colocated-8b sync alone"]
    assert (sync["before_median"], sync["after_median"], sync["ratio"]) == (22.0, 22.0, 1.0)
    assert [(p["pair"], p["before"], p["after"]) for p in sync["pairs"]] == [
        (1, 20.0, 21.0),
        (2, 22.0, 22.0),
        (3, 24.0, 26.0),
    ]
    assert sync["before_drift"] == pytest.approx(4 / 22) and sync["after_drift"] == pytest.approx(5 / 22)
    assert sync["verdict"] == "ok"
    assert rows["colocated-8b refit"]["before_median"] == 901.5  # step 0 left out: steps 1 and 2, 901 and 902
    assert rows["colocated-8b refit / flat D2H"]["verdict"] == "—"
    table = ab.render(list(rows.values()), runs)
    assert "left out: colocated-8b after pair 4: engine params differ from the trainer's after a refit" in table
    assert "left out: colocated-8b before pair 4: ran refitkit from ['/side/refitkit'], not /other/refitkit" in table


def test_a_resumed_call_runs_only_the_pairs_whose_slots_are_not_filled():
    args = ab.parse(["--before", "x", "--only", "weight-sync-8b,colocated-8b", "--order", "abba"])
    done = {("weight-sync-8b", side, 1) for side in ab.SIDES} | {("colocated-8b", "before", 2)}
    planned = [(first.label, second.label) for first, second in ab.plan(args, done)]
    assert planned == [
        ("colocated-8b before pair 1", "colocated-8b after pair 1"),
        ("weight-sync-8b after pair 2", "weight-sync-8b before pair 2"),
        ("colocated-8b after pair 2", "colocated-8b before pair 2"),  # one side alone is no pair: both again
        ("weight-sync-8b before pair 3", "weight-sync-8b after pair 3"),
        ("colocated-8b before pair 3", "colocated-8b after pair 3"),
    ]


def test_profile_reports_come_back_as_one_flat_folder_named_by_run(tmp_path):
    made = tmp_path / "scratch" / "profile"
    (made / "0.6b").mkdir(parents=True)
    (made / "0.6b" / "trainer_push.txt").write_text("trainer")
    (made / "0.6b" / "worker_push.txt").write_text("worker")
    copies = ab.flatten_reports(made, tmp_path / "out", "colocated-0.6b after pair 2")
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == [
        "colocated-0.6b-after-pair-2-0.6b-trainer_push.txt",
        "colocated-0.6b-after-pair-2-0.6b-worker_push.txt",
    ]
    assert [path.read_text() for path in copies] == ["trainer", "worker"]
    assert ab.flatten_reports(tmp_path / "none", tmp_path / "out", "x") == []  # a run that wrote none
