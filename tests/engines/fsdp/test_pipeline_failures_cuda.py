"""Failures cross pipeline stages on GPUs: the tensors over NCCL, the headers over refitkit's gloo group."""

from __future__ import annotations

import pytest
import torch

from tests.engines.fsdp import pipeline_ranks
from tests.helpers.world import run_world

pytestmark = [pytest.mark.timeout(300), pytest.mark.cuda]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_stage_failing_part_way_on_nccl_fails_both_ranks_at_once_and_leaves_nccl_working():
    pp_timeout_s = 20.0
    rank0, rank1 = run_world(pipeline_ranks.stage_fails_part_way_on_nccl, 2, pp_timeout_s, timeout_s=240)
    assert rank1["error_type"] == "InvalidInput" and "'layers.2.scale' is on meta" in rank1["error"], rank1
    assert rank0["error_type"] == "RankFailure" and "pipeline rank 1 (global rank 1)" in rank0["error"], rank0
    for outcome in (rank0, rank1):
        assert outcome["seconds"] < pp_timeout_s, outcome
        assert outcome["on_device"] and outcome["offloaded"], outcome
        assert outcome["nccl_all_reduce"] == 3.0
        assert outcome["names"] and outcome["equal"], outcome
