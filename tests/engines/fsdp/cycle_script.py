"""Runs benchmarks/multi_gpu_cycle.py in a child interpreter and reads its JSON lines (GPU tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.world import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def run_cycle_script(*args: str, timeout_s: float) -> tuple[list[dict], dict]:
    """(per-round records, the flat pinned-copy record) of one run; a failed run raises with its output."""
    command = [sys.executable, "-m", "benchmarks.multi_gpu_cycle", *args]
    done = subprocess.run(command, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
        )
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    rounds = [record for record in records if "round" in record]
    flat = [record for record in records if "flat_pinned_d2h_gbps" in record]
    if len(flat) != 1:
        raise AssertionError(f"no flat pinned-copy line in:\n{done.stdout[-4000:]}")
    return rounds, flat[0]


def check_rounds(rounds: list[dict], expected: int) -> None:
    """Every round: the receiver's copy equals the trainer's weights, nothing left on the device, finite loss."""
    assert [record["round"] for record in rounds] == list(range(expected)), rounds
    for record in rounds:
        assert record["receiver_matches"], record
        assert record["device_bytes_offloaded"] == 0, record
        assert record["loss"] == record["loss"] and record["sync_ms"] > 0, record
        assert record["offload_gbps"] > 0 and record["reload_gbps"] > 0, record
