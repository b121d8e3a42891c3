"""Failures cross ranks, bounded: every rank raises a refitkit error within the bounds the user set,
and the trainer's own process group stays usable (real spawned ranks over gloo)."""

from __future__ import annotations

import pytest

from tests.helpers.world import run_world
from tests.refit import ranks

pytestmark = pytest.mark.timeout(240)

TIMEOUT_S, BARRIER_TIMEOUT_S, LATE_S = 2.0, 20.0, 3.0


@pytest.fixture(scope="module")
def scenarios():
    """Every CPU scenario, run once in one two-rank world (see ranks.failure_scenarios)."""
    return run_world(ranks.failure_scenarios, 2, TIMEOUT_S, BARRIER_TIMEOUT_S, LATE_S, timeout_s=200)


def outcomes(scenarios, name):
    per_rank = [results[name] for results in scenarios]
    for rank, outcome in enumerate(per_rank):
        assert "crashed" not in outcome, f"rank {rank} crashed in {name}:\n{outcome['crashed']}"
    return per_rank


def test_a_sender_that_loses_its_receiver_fails_every_rank_within_the_bounds(scenarios):
    sender_rank, other_rank = outcomes(scenarios, "sender_loses_its_receiver")
    assert sender_rank["error_type"] == "TransferTimeout", sender_rank
    assert "timeout_s=2" in sender_rank["error"]
    assert other_rank["error_type"] == "RankFailure", other_rank
    assert "sync_weights failed on rank(s) 0" in other_rank["error"] and "TransferTimeout" in other_rank["error"]
    assert list(other_rank["failures"]) == [0]
    for outcome in (sender_rank, other_rank):
        assert outcome["seconds"] < TIMEOUT_S + BARRIER_TIMEOUT_S, outcome
        assert outcome["on_device"], "a failed sync must not offload anything"
        assert outcome["all_reduce"] == 3.0  # the trainer's group still works
    assert sender_rank["loss_after"] > 0 and other_rank["loss_after"] > 0


def test_a_rank_that_never_reaches_the_barrier_times_the_others_out_and_leaves_their_group_usable(scenarios):
    rank0, rank1 = outcomes(scenarios, "rank_misses_the_barrier")
    assert rank0["error_type"] == "BarrierTimeout", rank0
    # rank 1 never calls refit(): the exchange that opens every refit is where rank 0 stops waiting
    assert "barrier after training (every rank's arrival at refit) timed out after 1.5 s on rank 0" in rank0["error"]
    assert "barrier_timeout_s" in rank0["error"]
    assert rank0["seconds"] < 1.5 + 2.0
    assert rank0["all_reduce"] == rank1["all_reduce"] == 3.0  # the default group was never touched
    assert rank0["second_error"].startswith("RefitError: ") and "make a new RefitCycle" in rank0["second_error"]


def test_a_late_rank_holds_the_others_until_it_has_offloaded(scenarios):
    rank0, rank1 = outcomes(scenarios, "late_rank")
    assert rank0["returned_at"] >= rank1["offloaded_at"]
    assert rank0["refit_s"] > LATE_S - 1.0  # it really waited for the late rank


def test_an_offload_failure_on_one_rank_surfaces_on_every_rank_at_once(scenarios):
    rank0, rank1 = outcomes(scenarios, "offload_fails_on_one_rank")
    assert rank1["error_type"] == "InvalidInput" and "meta device" in rank1["error"], rank1
    assert rank0["error_type"] == "RankFailure", rank0
    assert "offload failed on rank(s) 1" in rank0["error"] and "meta device" in rank0["error"]
    assert rank0["seconds"] < BARRIER_TIMEOUT_S / 3 and rank1["seconds"] < BARRIER_TIMEOUT_S / 3  # not a timeout
    # rank 1 moved nothing; rank 0 reloaded what it had offloaded before raising: one state everywhere
    assert "rolled back: every rank reloaded what it had offloaded" in rank0["error"] and rank0["recovery"] is None
    assert rank0["state"] == rank1["state"] == "ON_DEVICE"
    assert rank0["resumed"] is True and rank1["resumed"] is True


def test_async_twins_keep_the_event_loop_running(scenarios):
    rank0, rank1 = outcomes(scenarios, "async_refit")
    assert rank0["phases"] == rank1["phases"] == ["sync_weights", "offload", "flush_device", "barrier"]
    assert rank0["state"] == rank1["state"] == "OFFLOADED"
    assert rank0["ticks"] > 30  # ~1 s of waiting for rank 1 with the loop ticking every 10 ms


@pytest.mark.cuda
def test_a_cuda_ipc_receiver_killed_mid_sync_fails_every_rank_and_frees_the_bucket():
    timeout_s, barrier_timeout_s = 5.0, 30.0
    rank0, rank1 = run_world(ranks.cuda_ipc_receiver_killed_mid_sync, 2, timeout_s, barrier_timeout_s, timeout_s=200)
    # TransferTimeout, or its PeerGone when the sender sees the connection break before its wait runs out
    assert rank0["error_type"] in ("TransferTimeout", "PeerGone"), rank0
    assert rank1["error_type"] == "RankFailure" and "sync_weights failed on rank(s) 0" in rank1["error"], rank1
    assert rank0["receiver_exit"] == -9 and rank0["bucket_freed"]
    for outcome in (rank0, rank1):
        assert outcome["seconds"] < timeout_s + barrier_timeout_s, outcome
        assert outcome["on_device"] and outcome["second_offloaded"], outcome
    assert rank0["fresh_ok"]


def _long_errors_and_close(rank: int, world_size: int) -> dict:
    import os

    from refitkit.ranks import RankGroup

    fds_before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        group = RankGroup(timeout_s=30.0)
        group.barrier("warm")
        group.close()
    fds_after = len(os.listdir("/proc/self/fd"))
    group = RankGroup(timeout_s=30.0)
    message = "\U0001f525" * 300 if rank == 1 else "x" * 2100  # 12 JSON bytes a character; 2100 that nearly fit
    try:
        group.settle("offload", RuntimeError(message))
    except RuntimeError as exc:
        own = str(exc)
    statuses = group.exchange("after")  # the group is still in step
    group.close()
    return {"fds_grew": fds_after - fds_before, "own_error_kept": own == message, "after": len(statuses)}


def test_long_error_messages_cross_cut_to_fit_and_closed_groups_free_their_sockets():
    # Before: 300 emoji made a record over 2048 bytes (a raw torch error before the collective, the other
    # rank waited out its timeout), and every RankGroup kept its gloo sockets and threads for good.
    rank0, rank1 = run_world(_long_errors_and_close, 2, timeout_s=90)
    for outcome in (rank0, rank1):
        assert outcome["own_error_kept"] and outcome["after"] == 2, outcome
        assert outcome["fds_grew"] <= 2, outcome


def test_a_rank_that_never_calls_refit_times_the_others_out_before_the_first_gather():
    """Before the arrival exchange, rank 0 sat in FSDP's all-gather on the trainer's group (on NCCL: until the
    watchdog kills the process; here rank 1's later all_reduce meets that gather and the world hangs)."""
    barrier_timeout_s, late_s = 1.5, 6.0
    rank0, rank1 = run_world(ranks.rank_never_calls_refit_with_fsdp, 2, barrier_timeout_s, late_s, timeout_s=60)
    assert rank0["error_type"] == "BarrierTimeout", rank0
    assert "training (every rank's arrival at refit)" in rank0["error"] and "barrier_timeout_s" in rank0["error"]
    assert rank0["seconds"] < barrier_timeout_s + 2.0, rank0
    assert rank0["on_device"], "nothing may move when a rank never arrived"
    assert rank0["all_reduce"] == rank1["all_reduce"] == 3.0
