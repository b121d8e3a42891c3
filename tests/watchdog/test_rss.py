"""RSSWatchdog: flags steady host growth with the right phase, never flat-but-noisy memory."""

from __future__ import annotations

import gc
import logging
import time

import pytest
import torch

from refitkit.errors import InvalidInput, LeakDetected
from refitkit.watchdog import RSSWatchdog
from refitkit.watchdog._trend import mann_kendall_p_increasing, theil_sen_slope
from tests.helpers.world import run_world
from tests.watchdog.synthetic import MIB, TraceSampler, run_cycles, trainer_trace

pytestmark = pytest.mark.timeout(120)


def first_leak(verdicts):
    return next((v for v in verdicts if v.leaking), None)


# --- the statistics ---------------------------------------------------------------------


def test_theil_sen_ignores_outliers_and_mann_kendall_sees_only_rises():
    line = [2.0 * i for i in range(12)]
    spiked = list(line)
    spiked[3] += 500.0
    spiked[8] -= 300.0
    assert theil_sen_slope(spiked) == pytest.approx(2.0)
    assert mann_kendall_p_increasing(line) < 1e-4
    assert mann_kendall_p_increasing(list(reversed(line))) == 1.0
    assert mann_kendall_p_increasing([7.0] * 12) == 1.0  # fully tied: no evidence


# --- synthetic traces through the injectable sampler ---------------------------------------


@pytest.mark.parametrize("seed", range(25))
def test_200_clean_noisy_cycles_are_never_flagged(seed):
    fired = []
    watchdog = RSSWatchdog(sampler=TraceSampler(trainer_trace(seed=seed)), on_leak=fired.append)
    verdicts = run_cycles(watchdog, 200)
    assert [v.cycle for v in verdicts if v.leaking] == []
    assert fired == []
    assert {v.status for v in verdicts[5:]} == {"ok"}
    assert verdicts[-1].window == 20


def test_one_off_step_is_not_a_leak():
    # a cache that grows once by 64 MiB at cycle 30, with the step in the middle of the window
    watchdog = RSSWatchdog(sampler=TraceSampler(trainer_trace(seed=1, step_at_cycle=30)))
    verdicts = run_cycles(watchdog, 60)
    assert not any(v.leaking for v in verdicts)
    assert max(v.slope_mib_per_cycle for v in verdicts) > 1.0  # the slope alone would have alarmed


@pytest.mark.parametrize(("leak_phase", "transient_mib"), [("train", 512.0), ("offload", 512.0), ("reload", 0.0)])
def test_planted_growth_is_flagged_within_10_cycles_with_its_phase(leak_phase, transient_mib):
    fired = []
    trace = trainer_trace(seed=3, leak_mib_per_cycle=2.0, leak_phase=leak_phase, transient_mib=transient_mib)
    watchdog = RSSWatchdog(sampler=TraceSampler(trace), on_leak=fired.append)
    verdicts = run_cycles(watchdog, 40)
    leak = first_leak(verdicts)
    assert leak is not None and leak.cycle <= 10
    assert leak.status == "growing" and leak.phase == leak_phase
    assert leak.slope_mib_per_cycle == pytest.approx(2.0, abs=0.6)
    assert fired and fired[0] is leak
    assert verdicts[-1].phase == leak_phase and verdicts[-1].slope_mib_per_cycle == pytest.approx(2.0, abs=0.2)


def test_phase_that_keeps_part_of_an_earlier_transient_is_named_as_the_taker():
    # offload takes 512 MiB, reload gives back all but 2: boundary samples cannot tell this
    # from offload keeping 2 MiB, and the watchdog documents that it names the taker
    trace = trainer_trace(seed=4, leak_mib_per_cycle=2.0, leak_phase="reload", transient_mib=512.0)
    verdict = run_cycles(RSSWatchdog(sampler=TraceSampler(trace)), 30)[-1]
    assert verdict.leaking and verdict.phase == "offload"
    assert verdict.growth_by_phase_mib["offload"] > 500 and -511 < verdict.growth_by_phase_mib["reload"] < -509


def test_on_leak_raise_raises_leak_detected_naming_phase_and_knob():
    trace = trainer_trace(seed=5, leak_mib_per_cycle=4.0, leak_phase="offload", transient_mib=0.0)
    watchdog = RSSWatchdog(sampler=TraceSampler(trace), on_leak="raise")
    with pytest.raises(LeakDetected, match=r"growing.*'offload'.*threshold_mib_per_cycle=1.0") as caught:
        run_cycles(watchdog, 20)
    assert caught.value.verdict.phase == "offload"
    assert watchdog.cycle <= 10


def test_on_leak_log_warns_once_per_episode(caplog):
    trace = trainer_trace(seed=6, leak_mib_per_cycle=4.0, transient_mib=0.0)
    watchdog = RSSWatchdog(sampler=TraceSampler(trace))
    with caplog.at_level(logging.WARNING, logger="refitkit.watchdog.rss"):
        verdicts = run_cycles(watchdog, 30)
    assert sum(v.leaking for v in verdicts) > 10
    warnings = [r for r in caplog.records if "RSSWatchdog" in r.getMessage()]
    assert len(warnings) == 1 and "growing" in warnings[0].getMessage()


def test_warmup_cycles_report_warmup_and_never_judge():
    trace = trainer_trace(seed=7, leak_mib_per_cycle=50.0, transient_mib=0.0)
    verdicts = run_cycles(RSSWatchdog(warmup=5, sampler=TraceSampler(trace)), 5)
    assert [v.status for v in verdicts] == ["warmup"] * 4 + ["ok"]
    assert verdicts[-1].window == 1


@pytest.mark.parametrize(
    ("kwargs", "knob"),
    [
        ({"window": 2}, "window"),
        ({"warmup": -1}, "warmup"),
        ({"threshold_mib_per_cycle": 0}, "threshold"),
        ({"on_leak": "shout"}, "on_leak"),
        ({"alpha": 1.5}, "alpha"),
    ],
)
def test_bad_knobs_are_invalid_input(kwargs, knob):
    with pytest.raises(InvalidInput, match=knob):
        RSSWatchdog(**kwargs)


# --- a real process --------------------------------------------------------------------------


class _Node:
    pass


def _real_cycles(rank, world_size, leak, cycles):
    """Train, offload, roll out, reload a small model each cycle; plant ``leak``; return the verdicts.

    The cycle leak goes in "rollout", not "offload": offload frees more than 1 MiB of storages on
    a CPU run, and boundary samples cannot separate a phase's own frees from its leak.
    """
    from refitkit.offload import HostArena, offload_optimizer, offload_tensors, reload_optimizer, reload_tensors

    if leak == "cycle":
        gc.disable()  # a leak only while nothing collects cycles, as in a GC-free refit loop
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
    optimizer = torch.optim.AdamW(model.parameters())
    arena = HostArena()
    hoard = []
    fired = []
    watchdog = RSSWatchdog(threshold_mib_per_cycle=0.5, on_leak=fired.append)
    verdicts = []
    for _ in range(cycles):
        scratch = torch.randn(1 << 20)  # 4 MiB of activations, freed at the end of the phase
        model(torch.randn(64, 256)).sum().backward()
        optimizer.step()
        del scratch
        watchdog.mark("train")
        offload_tensors(list(model.parameters()), arena)
        offload_optimizer(optimizer, arena)
        watchdog.mark("offload")
        rollout = torch.randn(1 << 19)  # the inference engine's turn; 2 MiB of scratch
        if leak == "cycle":
            node = _Node()
            node.me, node.payload = node, torch.ones(1 << 18)  # 1 MiB held only by a reference cycle
            del node
        del rollout
        watchdog.mark("rollout")
        reload_tensors(list(model.parameters()), arena)
        reload_optimizer(optimizer, arena)
        if leak == "bytes":
            hoard.append(b"\x01" * (1 << 20))  # written, so the pages are resident
        watchdog.mark("reload")
        verdicts.append(watchdog.end_cycle())
    return [(v.cycle, v.leaking, v.phase, v.slope_mib_per_cycle, v.rss_bytes) for v in verdicts], len(fired)


@pytest.fixture
def fixed_mmap_threshold(monkeypatch):
    """Pin glibc's mmap threshold in spawned ranks so every block >= 64 KiB is its own mapping (the ranks are fresh
    interpreters, not forks of the tests' fork server: glibc reads the variable when it starts).

    By default glibc raises the threshold when a big block is freed and then recycles freed
    heap memory; a leaked block then fills an old hole and RSS grows in whichever later phase
    extends the heap, so a real-process test could not check the phase deterministically.
    """
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")


@pytest.mark.usefixtures("fixed_mmap_threshold")
def test_real_process_cycle_leak_is_flagged_within_10_cycles_in_its_phase():
    ((verdicts, fired),) = run_world(_real_cycles, 1, "cycle", 12, fresh_interpreter=True)
    leaks = [v for v in verdicts if v[1]]
    assert leaks, f"not flagged: {verdicts}"
    cycle, _, phase, slope, _ = leaks[0]
    assert cycle <= 10 and phase == "rollout" and 0.9 < slope < 1.5
    assert fired == 1


@pytest.mark.usefixtures("fixed_mmap_threshold")
def test_real_process_plain_bytes_leak_is_flagged_in_its_phase():
    ((verdicts, fired),) = run_world(_real_cycles, 1, "bytes", 12, fresh_interpreter=True)
    leaks = [v for v in verdicts if v[1]]
    assert leaks, f"not flagged: {verdicts}"
    assert leaks[0][0] <= 10 and leaks[0][2] == "reload" and 0.9 < leaks[0][3] < 1.5


def test_real_process_clean_cycles_are_never_flagged():
    ((verdicts, fired),) = run_world(_real_cycles, 1, "none", 80)
    assert not [v for v in verdicts if v[1]], verdicts
    assert fired == 0
    rss = [v[4] for v in verdicts[10:]]
    assert max(rss) - min(rss) < 16 * MIB  # and it really was flat


def test_sample_overhead_is_under_50_us(capsys):
    watchdog = RSSWatchdog()
    for _ in range(200):
        watchdog.mark("warm")
    costs = []
    for _ in range(2000):
        start = time.perf_counter_ns()
        watchdog.mark("phase")
        costs.append(time.perf_counter_ns() - start)
    watchdog.end_cycle()
    costs.sort()
    median_us, p99_us = costs[len(costs) // 2] / 1e3, costs[int(len(costs) * 0.99)] / 1e3
    uss = RSSWatchdog(track_uss=True)
    start = time.perf_counter_ns()
    for _ in range(20):
        uss.end_cycle()
    end_cycle_us = (time.perf_counter_ns() - start) / 20 / 1e3
    with capsys.disabled():
        print(
            f"\nRSSWatchdog.mark: median {median_us:.1f} us, p99 {p99_us:.1f} us; "
            f"end_cycle with USS: {end_cycle_us:.0f} us"
        )
    assert median_us < 50.0
    assert uss.end_cycle().uss_bytes is None or uss.end_cycle().uss_bytes > 0
