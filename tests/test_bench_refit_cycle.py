"""benchmarks/refit_cycle.py end to end on CPU (tiny shapes): the smoke run `make bench` does without a GPU.

Timings on a loaded CI box mean nothing; what is checked is that every mode ran its rounds, moved
the bytes it should, that prepare() sized the whole arena, and that the receiver process's params
match the trainer's weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent


def test_the_tiny_refit_cycle_benchmark_runs_every_mode_and_delivers_the_weights(tmp_path):
    out = tmp_path / "refit_cycle.json"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
        OMP_NUM_THREADS="1",
    )
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/refit_cycle.py",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--rounds",
            "1",
            "--modes",
            "serial,overlap+prepare",
            "--heap-objects",
            "1000",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "receiver params match the trainer's weights" in done.stdout
    result = json.loads(out.read_text())
    (model,) = result["models"]
    assert model["model"] == "tiny" and model["intact"] is True
    assert [mode["mode"] for mode in model["modes"]] == ["serial", "overlap+prepare"]
    weights = model["weight_bytes"]
    for mode in model["modes"]:
        assert [r["round"] for r in mode["rounds"]] == ["first", "steady"]
        for r in mode["rounds"]:
            assert r["sync_bytes"] == weights
            # params + AdamW's exp_avg and exp_avg_sq (bf16, like the params) + its step scalars
            assert 3 * weights <= r["offload_bytes"] == r["reload_bytes"] < 3 * weights + 4096
            assert len(r["gc_by_generation"]) == 3
    prepared = model["modes"][1]
    assert prepared["prepared_bytes"] == prepared["arena_bytes"], "the first offload after prepare() allocated more"
    assert {row["mode"] for row in result["table"]} == {"serial", "overlap+prepare"}
