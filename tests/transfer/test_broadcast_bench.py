"""benchmarks/broadcast_sync.py end to end on CPU (gloo, tiny shapes): the smoke run of the NCCL benchmark.

Timings on a loaded CI box mean nothing; what is checked is that every sync landed the sender's bytes on
every receiver (the benchmark's digest, itself checked here to see a changed or moved word), that the
killed receiver ended the sender's session in a refitkit error within the bound, naming phase, bucket and
peer, that the surviving receiver reports its weights incomplete, and that a restarted receiver then
takes a whole session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.broadcast_sync import digest

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parent.parent.parent
TIMEOUT_S = 3.0


def test_the_digest_sees_a_changed_or_moved_word():
    base = torch.randn(1000, dtype=torch.float32).to(torch.bfloat16)
    changed, moved = base.clone(), base.clone()
    changed.view(torch.int16)[517] ^= 1  # one bit
    moved[[3, 4]] = moved[[4, 3]]
    assert moved[3] != moved[4]
    digests = {digest([t]) for t in (base, changed, moved)}
    assert len(digests) == 3 and digest([base.clone()]) == digest([base])


def test_the_cpu_broadcast_benchmark_lands_every_sync_and_survives_a_killed_receiver(tmp_path):
    out = tmp_path / "broadcast_sync.json"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
        OMP_NUM_THREADS="1",
    )
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/broadcast_sync.py",
            "--backend",
            "gloo",
            "--device",
            "cpu",
            "--model",
            "tiny",
            "--rounds",
            "1",
            "--receivers",
            "2",
            "--bucket-mib",
            "1",
            "--timeout-s",
            str(TIMEOUT_S),
            "--kill-receiver-at-bucket",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=140,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["model"] == "tiny" and result["bytes"] > 4 * result["half_bytes"]  # several buckets per sync
    (sync,) = result["rounds"]
    assert sync["intact"] and sync["error"] is None and sync["buckets"] > 3
    assert {r["version"][0] for r in sync["receivers"].values()} == {1}
    floor = result["floor"]
    assert floor["copy_gbps"] > 0 and floor["flat_bcast_gbps"] > 0 and sync["vs_flat_bcast"] > 0
    kill = result["kill"]
    assert kill["ok"] and kill["victim_exitcode"] == -9
    assert kill["error_type"] in ("TransferTimeout", "PeerGone", "TransferError")
    assert kill["seconds"] <= TIMEOUT_S + 5.0 == kill["bound_s"]
    assert kill["names_phase_bucket_peer"] and "bucket" in kill["message"] and "receiver rank" in kill["message"]
    assert kill["others"] == {"2": "TransferError"}  # told by the sender's abort
    assert kill["others_version"] == {"2": [1, 2]}  # version 2 failed part-way: incomplete
    after = kill["next_session"]
    assert after["intact"] and after["version"] == 3
    assert {rank: r["version"] for rank, r in after["receivers"].items()} == {"1": [3, None], "2": [3, None]}
    assert "kill case OK" in done.stdout
