"""benchmarks/multi_gpu_cycle.py with torchtitan's trainer objects on the GPU, streamed under HF names."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan", reason="needs the torchtitan env")

from tests.engines.fsdp.cycle_script import check_rounds, run_cycle_script  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]


def test_torchtitan_cycle_on_one_gpu():
    rounds, _ = run_cycle_script("--nproc", "1", "--engine", "torchtitan", "--rounds", "3", timeout_s=540)
    check_rounds(rounds, 3)


def test_torchtitan_fsdp_times_tp_cycle_on_every_gpu():
    count = torch.cuda.device_count()
    if count < 4:
        pytest.skip("FSDP x TP needs 4+ GPUs (the multi-GPU machine kinds)")
    rounds, _ = run_cycle_script(
        "--nproc", str(count), "--engine", "torchtitan", "--tp", "2", "--rounds", "2", timeout_s=540
    )
    check_rounds(rounds, 2)
