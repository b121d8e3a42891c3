"""Deterministic host-memory traces that look like a real trainer's, fed through an injectable sampler."""

from __future__ import annotations

import random
from collections.abc import Iterator

MIB = 1 << 20
PHASES = ("train", "offload", "reload")


class TraceSampler:
    """A sampler returning the next value of a scripted RSS trace (bytes) on every call."""

    def __init__(self, values: Iterator[float]) -> None:
        self._values = values
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        return int(next(self._values) * MIB)


def trainer_trace(
    *,
    seed: int,
    leak_mib_per_cycle: float = 0.0,
    leak_phase: str = "offload",
    step_at_cycle: int | None = 80,
    transient_mib: float = 512.0,
) -> Iterator[float]:
    """RSS in MiB at each sample of a 3-phase cycle (mark train, offload, reload, then end_cycle).

    Noise a real process shows: gaussian jitter (0.5 MiB), a big transient that the offload
    phase adds and reload gives back (pinned staging, 512 MiB), allocator creep that is trimmed
    every 16 cycles (sawtooth, 0.25 MiB/cycle), rare one-cycle spikes (20-60 MiB) and, once,
    a persistent step (a cache growing by 64 MiB). The first value is the construction sample.
    """
    rng = random.Random(seed)
    base = 2048.0
    leaked = 0.0
    yield base
    cycle = 0
    while True:
        cycle += 1
        if step_at_cycle is not None and cycle == step_at_cycle:
            base += 64.0
        creep = 0.25 * (cycle % 16)
        spike = rng.uniform(20.0, 60.0) if rng.random() < 0.03 else 0.0
        for phase in PHASES:
            if phase == leak_phase:
                leaked += leak_mib_per_cycle
            transient = transient_mib if phase == "offload" else 0.0
            yield base + creep + leaked + transient + spike + rng.gauss(0.0, 0.5)
        yield base + creep + leaked + spike + rng.gauss(0.0, 0.5)  # end_cycle's sample


def run_cycles(watchdog, cycles: int):
    """Drive ``cycles`` cycles of mark(train/offload/reload) + end_cycle; returns the verdicts."""
    verdicts = []
    for _ in range(cycles):
        for phase in PHASES:
            watchdog.mark(phase)
        verdicts.append(watchdog.end_cycle())
    return verdicts
