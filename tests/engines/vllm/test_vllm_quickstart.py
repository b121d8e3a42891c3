"""examples/vllm_quickstart.py (quoted by the README) runs as typed on this machine's vLLM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engines.vllm.tiny_llama import random_llama, save_checkpoint

pytestmark = pytest.mark.timeout(420)

ROOT = Path(__file__).resolve().parents[3]


def test_the_quickstart_script_runs_as_typed(tmp_path):
    checkpoint = str(tmp_path / "tiny-llama")
    save_checkpoint(random_llama(seed=0), checkpoint)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "vllm_quickstart.py"), checkpoint],
        capture_output=True, text=True, timeout=400, env=env, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert lines == [
        "step 0: vLLM serves weight version 0, sampled 8 tokens",
        "step 1: vLLM serves weight version 1, sampled 8 tokens",
    ]
