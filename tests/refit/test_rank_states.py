"""A failure on one rank, in any phase of refit() / resume(), leaves every rank in one known state: all back on the
device (the next refit() works as is), or all told in their error the one call that recovers, and that call works.
Real FSDP2 ranks over gloo in spawned processes, 2 and 3 of them; the failures are planted in the adapter's own
moves and the sending rank's engine link (tests/refit/phase_ranks.py); docs/failures.md has the table."""

from __future__ import annotations

import pytest

from tests.helpers.world import run_world
from tests.refit import phase_ranks

pytestmark = pytest.mark.timeout(400)

RESUME = "call cycle.resume() on every rank"
NEW_CYCLE = "make a new RefitCycle on every rank"
BARRIER_TIMEOUT_S, STALL_S = 3.0, 5.0
ON, OFF = "ON_DEVICE", "OFFLOADED"
NAMES = [*phase_ranks.SCENARIOS, "offload_barrier_times_out"]


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def world(request):
    """Every scenario, one after another, in one world of 2 (then 3) ranks; the last rank is the one that fails."""
    size = request.param
    results = run_world(phase_ranks.every_phase, size, NAMES, BARRIER_TIMEOUT_S, STALL_S, timeout_s=360)
    return size, results


def outcomes(world, name):
    size, results = world
    per_rank = [result[name] for result in results]
    for rank, outcome in enumerate(per_rank):
        assert "crashed" not in outcome, f"rank {rank} of {size} crashed in {name}:\n{outcome['crashed']}"
    return per_rank


def assert_recovers(outcome, rank, *, via_call=True):
    """The recovery the error named (if any) worked, then a whole refit + resume did, bit-exact."""
    if via_call:
        assert outcome["recovery_call"] == {"error_type": None}, (rank, outcome["recovery_call"])
        assert outcome["after_recovery"] == [ON, ON, ON], (rank, outcome)
    assert outcome["next_refit"] == {"error_type": None}, (rank, outcome["next_refit"])
    assert outcome["next_refit_states"] == [OFF, OFF, OFF], (rank, outcome)
    assert outcome["next_resume"] == {"error_type": None}, (rank, outcome["next_resume"])
    assert outcome["final_states"] == [ON, ON, ON] and outcome["intact"], (rank, outcome)
    assert outcome["engine_exact"] is (True if rank == 0 else None), (rank, outcome)


def assert_told(outcome, rank, *, phase, failed, recovery):
    """A rank where the phase succeeded: RankFailure naming the failed ranks and the recovery."""
    assert outcome["error_type"] == "RankFailure", (rank, outcome)
    assert (
        f"{phase} failed on rank(s) {', '.join(map(str, failed))} (this is rank {rank}, where it succeeded)"
        in outcome["error"]
    )
    assert sorted(outcome["failures"]) == sorted(failed), (rank, outcome)
    assert outcome["recovery"] == recovery, (rank, outcome)
    if recovery is not None:
        assert outcome["error"].endswith(f": {recovery}"), (rank, outcome["error"])


def test_a_failed_sync_offloads_nothing_anywhere_and_the_next_refit_works(world):
    for rank, outcome in enumerate(outcomes(world, "sync_fails")):
        if rank == 0:
            assert outcome["error_type"] == "RuntimeError" and outcome["error"] == "planted: the engine refused send"
            assert outcome["recovery"] is None
        else:
            assert_told(outcome, rank, phase="sync_weights", failed=[0], recovery=None)
        assert outcome["states"] == [ON, ON, ON], (rank, outcome)
        assert_recovers(outcome, rank, via_call=False)


def test_an_offload_that_fails_part_way_on_the_last_rank_is_rolled_back_on_every_rank(world):
    """Before: the other ranks raised RankFailure but stayed OFFLOADED, and the next refit() failed on every rank
    ("named_weights(): the model is offloaded") until each called resume(), which no error said."""
    size, _ = world
    last = size - 1
    for rank, outcome in enumerate(outcomes(world, "offload_fails")):
        assert outcome["states"] == [ON, ON, ON], (rank, outcome)  # model, optimizer, grads: back on every rank
        if rank == last:  # its own error, as it was raised (the optimizer state was offloaded, then the params failed)
            assert outcome["states_at_failure"] == [ON, OFF, OFF], outcome
            assert outcome["error_type"] == "RuntimeError", outcome
            assert outcome["error"] == f"planted: offload failed on rank {last}"
            assert outcome["recovery"] is None
        else:
            assert_told(outcome, rank, phase="offload", failed=[last], recovery=None)
            assert f"rank {last} in offload: RuntimeError: planted: offload failed on rank {last}" in outcome["error"]
            assert "rolled back: every rank reloaded what it had offloaded" in outcome["error"]
            assert "the next refit() works as is" in outcome["error"]
        assert outcome["intact_after_rollback"] and outcome["arena_held_bytes"] == 0, (rank, outcome)
        assert outcome["engine"] == ("weights awake" if rank == 0 else None)  # synced, its KV cache never woken
        assert_recovers(outcome, rank, via_call=False)  # the next refit() as is


def test_a_rollback_that_fails_tells_every_rank_to_resume_and_resume_recovers(world):
    size, _ = world
    last = size - 1
    per_rank = outcomes(world, "rollback_fails")
    for rank, outcome in enumerate(per_rank):
        if rank == 0:  # its rollback (the reload) failed part-way: its own error is the cause
            assert outcome["error_type"] == "RecoveryNeeded", outcome
            assert outcome["cause_type"] == "RefitError" and "planted: reload failed on rank 0" in outcome["cause"]
            assert outcome["states"] == [OFF, OFF, OFF], outcome
        elif rank == last:  # its offload failed: its own error is the cause
            assert outcome["error_type"] == "RecoveryNeeded", outcome
            assert (
                outcome["cause_type"] == "RuntimeError"
                and outcome["cause"] == f"planted: offload failed on rank {last}"
            )
            assert outcome["states"] == [ON, ON, ON], outcome
        else:
            assert outcome["error_type"] == "RankFailure", outcome
            assert outcome["states"] == [ON, ON, ON], outcome
        assert outcome["recovery"] == RESUME and outcome["error"].endswith(f": {RESUME}"), (rank, outcome)
        assert f"offload failed on rank(s) {last}, 0" in outcome["error"], (rank, outcome)
        assert f"rank {last} in offload: RuntimeError: planted: offload failed on rank {last}" in outcome["error"]
        assert "rank 0 in rollback" in outcome["error"] and "planted: reload failed on rank 0" in outcome["error"]
        assert "failed on rank(s) 0, which stay offloaded" in outcome["error"]
        assert sorted(outcome["failures"]) == sorted({0, last}), (rank, outcome)
        assert_recovers(outcome, rank)


def test_a_kv_cache_that_does_not_wake_leaves_every_rank_offloaded_and_says_resume(world):
    for rank, outcome in enumerate(outcomes(world, "kv_wake_fails")):
        if rank == 0:
            assert outcome["error_type"] == "RecoveryNeeded" and outcome["cause_type"] == "RuntimeError", outcome
            assert outcome["cause"] == "planted: the engine refused wake_for_rollout"
            assert outcome["recovery"] == RESUME and outcome["error"].endswith(f": {RESUME}")
            assert outcome["engine"] == "weights awake"
        else:
            assert_told(outcome, rank, phase="engine_wake_kv_cache", failed=[0], recovery=RESUME)
        assert "every rank's state stays offloaded" in outcome["error"]
        assert outcome["states"] == [OFF, OFF, OFF], (rank, outcome)
        assert_recovers(outcome, rank)


def test_an_engine_that_does_not_sleep_leaves_every_rank_offloaded_and_resume_again_recovers(world):
    for rank, outcome in enumerate(outcomes(world, "engine_sleep_fails")):
        if rank == 0:
            assert (
                outcome["error_type"] == "RecoveryNeeded"
                and outcome["cause"] == "planted: the engine refused sleep_for_training"
            )
            assert outcome["recovery"] == RESUME
        else:
            assert_told(outcome, rank, phase="engine_sleep", failed=[0], recovery=RESUME)
        assert "no rank's state was reloaded" in outcome["error"]
        assert outcome["states"] == [OFF, OFF, OFF], (rank, outcome)
        assert_recovers(outcome, rank)


def test_a_reload_that_fails_part_way_on_one_rank_says_resume_again_and_that_recovers(world):
    size, _ = world
    last = size - 1
    for rank, outcome in enumerate(outcomes(world, "reload_fails")):
        if rank == last:
            assert outcome["error_type"] == "RecoveryNeeded" and outcome["cause_type"] == "RefitError", outcome
            assert (
                f"planted: reload failed on rank {last}" in outcome["cause"] and "call reload again" in outcome["cause"]
            )
            assert outcome["recovery"] == RESUME and outcome["error"].endswith(f": {RESUME}")
            assert outcome["states"] == [OFF, OFF, OFF], outcome  # every byte still in its arena
        else:
            assert_told(outcome, rank, phase="reload", failed=[last], recovery=RESUME)
            assert outcome["states"] == [ON, ON, ON], (rank, outcome)
        assert "the ranks where the reload failed stay offloaded" in outcome["error"]
        assert_recovers(outcome, rank)


def test_a_deferred_optimizer_copy_that_fails_is_raised_on_its_rank_only_and_reload_recovers_it(world):
    size, _ = world
    last = size - 1
    for rank, outcome in enumerate(outcomes(world, "deferred_fails")):
        assert outcome["error_type"] is None, (rank, outcome)  # resume() had returned everywhere
        if rank == last:
            step = outcome["step"]
            assert step["error_type"] == "RefitError", step
            assert "deferred reload of PlantedAdapter's optimizer state failed" in step["error"]
            assert "planted: deferred copy of" in step["error"] and "call reload() again" in step["error"]
            assert outcome["states"] == [ON, OFF, ON], outcome  # the optimizer's bytes still in the arena
            assert_recovers(outcome, rank)  # (its adapter.reload())
        else:
            assert outcome["step"] == {"error_type": None} and outcome["states"] == [ON, ON, ON], (rank, outcome)
            assert_recovers(outcome, rank, via_call=False)


def test_the_async_twins_leave_the_same_states(world):
    size, _ = world
    last = size - 1
    for rank, outcome in enumerate(outcomes(world, "async_twins")):
        if rank == last:
            assert outcome["arefit"]["error_type"] == "RuntimeError", outcome
            assert outcome["aresume"]["error_type"] == "RecoveryNeeded", outcome
        else:
            assert outcome["arefit"]["error_type"] == "RankFailure" and "rolled back" in outcome["arefit"]["error"]
            assert outcome["aresume"]["error_type"] == "RankFailure", outcome
        assert outcome["arefit"]["recovery"] is None and outcome["aresume"]["recovery"] == RESUME, (rank, outcome)
        assert outcome["arefit_states"] == [ON, ON, ON], (rank, outcome)
        assert outcome["arefit_again"] == {"error_type": None}, (rank, outcome)
        assert outcome["aresume_states"] == ([OFF, OFF, OFF] if rank == last else [ON, ON, ON]), (rank, outcome)
        assert outcome["aresume_again"] == {"error_type": None}, (rank, outcome)
        assert outcome["final_states"] == [ON, ON, ON] and outcome["intact"], (rank, outcome)
        assert outcome["engine_exact"] is (True if rank == 0 else None)


def test_a_rank_stuck_in_its_offload_times_every_rank_out_rolled_back_and_a_new_cycle_works(world):
    size, _ = world
    for rank, outcome in enumerate(outcomes(world, "offload_barrier_times_out")):
        assert outcome["error_type"] == "BarrierTimeout", (rank, outcome)
        assert "barrier after offload " in outcome["error"] and "barrier_timeout_s" in outcome["error"]
        assert outcome["recovery"] == NEW_CYCLE and outcome["error"].endswith(f"this rank group is spent: {NEW_CYCLE}")
        assert outcome["states"] == [ON, ON, ON], (rank, outcome)  # each rank reloaded what it had offloaded
        assert_recovers(outcome, rank, via_call=False)  # on the new cycle
