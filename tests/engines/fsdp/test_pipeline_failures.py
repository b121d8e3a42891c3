"""Failures cross pipeline stages, bounded: a stage that fails part-way (or stalls) while every stage's
weights are forwarded makes every rank raise a refitkit error within refitkit's bound, not the process
group's, and leaves the trainer's groups and the next refit working (real spawned ranks over gloo)."""

from __future__ import annotations

import pytest

from tests.engines.fsdp import pipeline_ranks
from tests.helpers.world import run_world

pytestmark = pytest.mark.timeout(240)

PP_TIMEOUT_S = 15.0  # refitkit's bound (pp_timeout_s)
PG_TIMEOUT_S = 45.0  # the trainer's own pipeline group: without refitkit's bound a rank waits this long


def _check_recovered(outcome: dict, rank: int) -> None:
    assert outcome["on_device"], f"rank {rank}: a failed sync must not offload anything"
    assert outcome["all_reduce"] in (3.0, 10.0), outcome  # the default group still works (world 2 / 4)
    assert outcome["offloaded"], f"rank {rank}: the next refit must go through"


def test_a_stage_failing_part_way_fails_every_pipeline_rank_at_once_and_the_next_refit_is_bit_exact():
    # Before: rank 0 (receiving stage 1) waited in the pipeline group's broadcast until the group's own
    # timeout, then raised gloo's RuntimeError (not a refitkit error), PG_TIMEOUT_S after the failure.
    sender, failing = run_world(pipeline_ranks.stage_fails_part_way, 2, 1, PP_TIMEOUT_S, PG_TIMEOUT_S, timeout_s=200)
    assert failing["error_type"] == "InvalidInput", failing
    assert (
        "'layers.2.scale' is on meta" in failing["error"] and "keep every model part on one device" in failing["error"]
    )
    assert sender["error_type"] == "RankFailure", sender
    assert "pipeline stage stream failed on pipeline rank 1 (global rank 1)" in sender["error"]
    assert "InvalidInput: pipeline stage stream: 'layers.2.scale' is on meta" in sender["error"]
    assert list(sender["failures"]) == [1]
    for rank, outcome in enumerate((sender, failing)):
        assert outcome["seconds"] < PP_TIMEOUT_S, outcome  # told at once: no timeout waited out
        _check_recovered(outcome, rank)
    assert sender["receiver_error"] is None and sender["received_names"] and sender["received_equal"], sender


def test_one_data_parallel_rank_of_a_sharded_stage_failing_fails_every_rank_and_its_peers_finish_their_gathers():
    # PP2 x FSDP2: rank 0 (stage 0, dp 0) fails after its first layer; rank 2 hears it through its pipeline
    # group and must still run stage 1's gathers with rank 3, whose own pipeline group streams on untroubled.
    outcomes = run_world(pipeline_ranks.stage_fails_part_way, 4, 0, PP_TIMEOUT_S, PG_TIMEOUT_S, timeout_s=220)
    failing, peer, told, far = outcomes
    assert failing["error_type"] == "InvalidInput" and "'layers.0.scale' is on meta" in failing["error"], failing
    assert told["error_type"] == "RankFailure" and "pipeline rank 0 (global rank 0)" in told["error"], told
    assert list(told["failures"]) == [0], told
    for outcome in (peer, far):  # their own streams went through; the cycle's exchange tells them
        assert outcome["error_type"] == "RankFailure", outcome
        assert outcome["error"].startswith("sync_weights failed on rank(s) 0, 2"), outcome
    for rank, outcome in enumerate(outcomes):
        assert outcome["seconds"] < PP_TIMEOUT_S, outcome
        _check_recovered(outcome, rank)
    assert failing["receiver_error"] is None and failing["received_names"] and failing["received_equal"], failing


def test_a_stage_rank_that_stalls_times_the_others_out_naming_the_knob():
    stall_s, pp_timeout_s = 8.0, 3.0
    waiting, stalled = run_world(pipeline_ranks.stage_rank_stalls, 2, pp_timeout_s, stall_s, timeout_s=120)
    assert waiting["first_names"] == stalled["first_names"] and len(waiting["first_names"]) == 10
    assert waiting["error_type"] == "TransferTimeout", waiting
    assert (
        "the next header from pipeline rank 1 (global rank 1) did not come within pp_timeout_s=3 on rank 0"
        in waiting["error"]
    ), waiting
    assert pp_timeout_s - 0.5 < waiting["seconds"] < pp_timeout_s + 5.0, waiting
    assert waiting["second_error"].startswith("RefitError: ") and "make a new adapter" in waiting["second_error"]
    assert waiting["all_reduce"] == stalled["all_reduce"] == 3.0


def test_a_header_longer_than_one_record_arrives_whole():
    for outcome in run_world(pipeline_ranks.long_names_cross, 2, PP_TIMEOUT_S, timeout_s=120):
        assert outcome == {"names": True, "equal": True}


def test_a_forged_weight_header_is_a_protocol_error_naming_the_pipeline_rank():
    receiver, _ = run_world(pipeline_ranks.forged_headers, 2, PP_TIMEOUT_S, timeout_s=120)
    for what, _fields in pipeline_ranks.FORGED_HEADERS[:-1]:
        outcome = receiver[what]
        assert outcome["error_type"] == "ProtocolError", (what, outcome)
        assert "pipeline rank 1 sent" in outcome["error"], (what, outcome)
    # a consistent header too large to allocate names the weight and its sender
    huge = receiver["a huge shape announced whole"]
    assert huge["error_type"] == "TransferError" and "'w' [2147483648, 1073741824]" in huge["error"], huge
    assert "from pipeline rank 1" in huge["error"], huge
    assert "shape" in receiver["a negative dim"]["error"] and "non-negative ints" in receiver["a negative dim"]["error"]
    assert "unknown dtype 'Tensor'" in receiver["an unknown dtype"]["error"]
    assert "announced 24 bytes" in receiver["a huge shape announced small"]["error"]
    # nothing was allocated from a forged header and the header group stayed in step
    assert receiver["after"] == [("w", [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])]
