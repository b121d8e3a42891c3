"""The driving side's helper threads for an engine's blocking calls (``refitkit.rollout.sessions``)."""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from refitkit.errors import EngineTimeout
from refitkit.rollout.sessions import bounded_call

pytestmark = pytest.mark.timeout(60)


def _caller_thread() -> int:
    return threading.get_ident()


def test_engine_calls_reuse_an_idle_helper_thread_and_never_one_whose_call_is_stuck():
    first = bounded_call(_caller_thread, timeout_s=5, what="a call", within="5 s")
    assert bounded_call(_caller_thread, timeout_s=5, what="a call", within="5 s") == first  # the warm thread again

    release, stuck_on = threading.Event(), []

    def stuck() -> None:
        stuck_on.append(threading.get_ident())
        release.wait(30)

    try:
        with pytest.raises(EngineTimeout, match=r"a stuck call did not return within 0\.2 s"):
            bounded_call(stuck, timeout_s=0.2, what="a stuck call", within="0.2 s")
        # the next calls run at once, never queued behind the stuck one
        later = {bounded_call(_caller_thread, timeout_s=5, what="a call", within="5 s") for _ in range(3)}
        assert stuck_on and stuck_on[0] not in later
    finally:
        release.set()


def _call_in_child(results: multiprocessing.Queue) -> None:
    results.put(bounded_call(lambda: "ran", timeout_s=5, what="a call in the child", within="5 s"))


def test_a_forked_child_gets_helper_threads_of_its_own():
    bounded_call(_caller_thread, timeout_s=5, what="a call", within="5 s")  # an idle pool in the parent
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_call_in_child, args=(results,))
    child.start()
    try:
        assert results.get(timeout=20) == "ran"  # the parent's pool has no threads in the child: it must not be used
    finally:
        child.join(20)
    assert child.exitcode == 0
