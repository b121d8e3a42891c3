"""benchmarks/node_cycle.py runs end to end on CPU (gloo, two ranks, a receiver per rank): the smoke test of
the script the lead runs unchanged on 2, 4 or 8 GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.world import child_env

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_node_cycle(*args: str, timeout_s: float) -> tuple[dict, list[dict]]:
    """(the limits record, the per-round records) of one run; a failed run raises with its output."""
    command = [sys.executable, "-m", "benchmarks.node_cycle", *args]
    done = subprocess.run(command, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
        )
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    limits = [record for record in records if "limits" in record]
    assert len(limits) == 1, done.stdout
    return limits[0], [record for record in records if "round" in record]


@pytest.mark.parametrize("receivers", ["per-gpu", "rank0"])
def test_node_cycle_runs_on_two_cpu_ranks(receivers):
    limits, rounds = run_node_cycle(
        "--device",
        "cpu",
        "--backend",
        "gloo",
        "--model",
        "tiny",
        "--nproc",
        "2",
        "--rounds",
        "2",
        "--receivers",
        receivers,
        timeout_s=100,
    )
    flat = limits["limits"]
    assert limits["world_size"] == 2
    for direction in ("d2h", "h2d"):
        assert len(flat[f"concurrent_{direction}_gbps_per_gpu"]) == 2
        assert flat[f"concurrent_{direction}_gbps_total"] > 0 and flat[f"alone_{direction}_gbps"] > 0
    assert [record["round"] for record in rounds] == [0, 1]
    for record in rounds:
        expected_match = [True, True] if receivers == "per-gpu" else [True, None]
        assert record["receivers_match"] == expected_match, record
        assert record["left_on_device"] == [0, 0], record  # every rank offloaded everything
        assert all(n > 10 << 20 for n in record["state_bytes_per_rank"]), record  # tiny Qwen3 shapes + AdamW
        assert len(record["offload_gbps_per_rank"]) == len(record["reload_gbps_per_rank"]) == 2
        assert record["offload_gbps_total"] > 0 and record["reload_gbps_total"] > 0, record
        assert record["offload_total_vs_concurrent"] > 0, record
        assert record["barrier_wait_on_slowest_ms"] == max(record["barrier_ms_per_rank"]), record
        assert record["slowest_rank"] in (0, 1)
        assert all(ms > 0 for ms in record["sync_ms_per_rank"]), record
