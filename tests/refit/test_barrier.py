"""bounded_barrier: lines ranks up, or ends in BarrierTimeout naming the knob, never hangs."""

from __future__ import annotations

import time

from refitkit.errors import BarrierTimeout
from refitkit.refit import bounded_barrier
from tests.helpers.world import run_world


def _late_rank(rank: int, world_size: int, delay_s: float, timeout_s: float, joins: bool = True) -> dict:
    if rank == 1:
        time.sleep(delay_s)  # this rank is late on purpose; the test is about rank 0's bound
        if joins:
            bounded_barrier(timeout_s=timeout_s, phase="offload")
        return {"rank": rank}
    start = time.monotonic()
    try:
        bounded_barrier(timeout_s=timeout_s, phase="offload")
    except BarrierTimeout as exc:
        return {"rank": rank, "error": str(exc), "waited_s": time.monotonic() - start}
    return {"rank": rank, "waited_s": time.monotonic() - start}


def test_barrier_passes_when_all_ranks_arrive():
    results = run_world(_late_rank, 2, 0.5, 30.0, timeout_s=60)
    assert "error" not in results[0], results[0]
    assert 0.4 < results[0]["waited_s"] < 30.0  # it really waited for the late rank


def test_a_missing_rank_ends_in_barrier_timeout_within_the_bound():
    results = run_world(_late_rank, 2, 4.0, 1.5, False, timeout_s=60)
    assert "error" in results[0], results[0]
    assert "barrier after offload timed out after 1.5 s on rank 0" in results[0]["error"]
    assert "barrier_timeout_s" in results[0]["error"]
    assert results[0]["waited_s"] < 1.5 + 1.0


def test_without_a_process_group_the_barrier_is_a_no_op():
    assert bounded_barrier(timeout_s=0.1) == 0.0


def _two_timeouts(rank: int, world_size: int) -> dict:
    bounded_barrier(timeout_s=10.0, phase="startup")  # the first call makes a group with a 10 s timeout
    if rank == 1:
        time.sleep(4.0)  # 4 s late for a 1 s barrier
    start = time.monotonic()
    try:
        bounded_barrier(timeout_s=1.0, phase="step")
        outcome = "passed"
    except Exception as exc:
        outcome = type(exc).__name__
    return {"outcome": outcome, "seconds": time.monotonic() - start}


def test_a_shorter_timeout_is_the_collectives_own_bound_on_every_rank():
    # Before: the group kept the first call's 10 s timeout, so rank 1 passed the barrier rank 0 had given up on.
    rank0, rank1 = run_world(_two_timeouts, 2, timeout_s=90)
    assert rank0["outcome"] == "BarrierTimeout", rank0
    assert rank1["outcome"] != "passed", rank1  # nobody passes a barrier another rank failed
    assert rank0["seconds"] < 1.0 + 2.0
