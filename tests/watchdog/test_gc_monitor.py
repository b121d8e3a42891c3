"""GcMonitor: every collection counted per generation and phase, explicit apart from automatic."""

from __future__ import annotations

import gc

import pytest

from refitkit.watchdog import GcMonitor

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def gc_settings():
    state = (gc.isenabled(), gc.get_threshold())
    yield
    gc.set_threshold(*state[1])
    (gc.enable if state[0] else gc.disable)()


def churn_cycles(count: int) -> None:
    """Allocate container objects in cycles so generation-0 counts climb past the threshold."""
    for _ in range(count):
        a, b = [], []
        a.append(b)
        b.append(a)


def test_counts_an_explicit_and_an_automatic_collection_separately(gc_settings):
    gc.enable()
    gc.set_threshold(100, 1000, 1000)  # gen-0 only, and often
    with GcMonitor() as monitor:
        with monitor.phase("rollout"):
            churn_cycles(2000)  # automatic gen-0 collections happen here
        with monitor.phase("cleanup"):
            gc.collect()
    summary = monitor.summary()
    assert summary["rollout"].automatic_by_generation[0] >= 5
    assert summary["rollout"].explicit == 0
    assert summary["rollout"].collected > 0
    assert summary["cleanup"].explicit == 1 and summary["cleanup"].automatic == 0
    assert summary["cleanup"].explicit_s > 0
    explicit = [e for e in monitor.events if e.explicit]
    assert len(explicit) == 1 and explicit[0].generation == 2 and explicit[0].phase == "cleanup"


def test_explicit_collection_with_gc_disabled_is_explicit(gc_settings):
    gc.disable()
    churn_cycles(5000)  # counts climb far past the threshold with nothing collecting
    with GcMonitor() as monitor:
        gc.collect(0)
        monitor.mark("offload")
    assert monitor.summary()["offload"].explicit == 1
    assert monitor.totals().automatic == 0


def test_a_collect_bound_before_monitoring_is_still_explicit(gc_settings):
    from gc import collect  # bypasses the gc.collect wrapper

    gc.enable()
    with GcMonitor() as monitor:
        collect()
        monitor.mark("reload")
    assert monitor.summary()["reload"].explicit == 1


def test_mark_charges_collections_since_the_previous_mark(gc_settings):
    gc.enable()
    gc.set_threshold(100, 1000, 1000)
    with GcMonitor() as monitor:
        gc.collect()
        monitor.mark("train")
        churn_cycles(1000)
        monitor.mark("offload")
        monitor.mark("reload")
    summary = monitor.summary()
    assert summary["train"].explicit == 1 and summary["train"].automatic == 0
    assert summary["offload"].automatic >= 3 and summary["offload"].explicit == 0
    assert "reload" not in summary


def test_stop_unhooks_and_restores_gc_collect():
    original = gc.collect
    monitor = GcMonitor().start()
    assert gc.collect is not original and monitor._on_gc in gc.callbacks
    with GcMonitor():  # a second monitor shares the wrapper
        pass
    assert gc.collect is not original
    monitor.stop()
    assert gc.collect is original and monitor._on_gc not in gc.callbacks
    gc.collect()
    assert monitor.totals().explicit == 0  # nothing counted after stop
