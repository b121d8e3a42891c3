"""benchmarks/multi_gpu_cycle.py with FSDP2 on the GPU: stream to a CUDA IPC receiver, offload, reload, train."""

from __future__ import annotations

import pytest
import torch

from tests.engines.fsdp.cycle_script import check_rounds, run_cycle_script

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]


def test_fsdp2_cycle_on_one_gpu():
    rounds, flat = run_cycle_script("--nproc", "1", "--rounds", "3", timeout_s=540)
    check_rounds(rounds, 3)
    assert flat["flat_pinned_d2h_gbps"] > 1 and flat["bytes_per_rank"] > 1 << 30  # Qwen3-0.6B-sized + AdamW


def test_fsdp2_cycle_on_every_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2+ GPUs (the multi-GPU machine kinds)")
    rounds, _ = run_cycle_script("--nproc", str(torch.cuda.device_count()), "--rounds", "2", timeout_s=540)
    check_rounds(rounds, 2)
