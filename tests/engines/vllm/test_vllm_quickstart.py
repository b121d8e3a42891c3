"""examples/vllm_quickstart.py (quoted by the README) runs as typed on this machine's vLLM: offline, no argument."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(420)

ROOT = Path(__file__).resolve().parents[3]


def test_the_quickstart_script_runs_as_typed_offline_without_a_model(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf-home"),  # no hub, no cache
    }
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "vllm_quickstart.py")],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        cwd=tmp_path,  # not the checkout: as a user types it
    )
    assert result.returncode == 0, result.stderr[-4000:]
    wrote = re.search(r"^no model given: wrote a tiny local Llama \(random weights\) to (\S+)$", result.stdout, re.M)
    assert wrote is not None, result.stdout
    assert not Path(wrote.group(1)).exists()  # the example's temporary checkpoint is gone
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert lines == [
        "step 0: vLLM serves weight version 0, sampled 8 tokens",
        "step 1: vLLM serves weight version 1, sampled 8 tokens",
    ]
