"""Rank functions for tests/refit/test_rank_states.py: a failure planted on one rank in each phase of refit() and
resume(), then every rank's state, error and recovery (spawned by tests.helpers.world.run_world).

Real FSDP2 over gloo (every refit gathers the full weights, a collective), real offloads into each rank's arena. The
failures are planted in the adapter's own moves (``PlantedAdapter``) and in the sending rank's engine link
(``PlantedLink``); each armed point raises once, as a real transient failure (a copy that fails, an engine that
refuses once) would.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from refitkit.engines.fsdp import FSDPAdapter
from refitkit.refit import RefitCycle
from tests.engines.fsdp.ranks import build, local_state, train_step
from tests.helpers.bits import bits_equal


class PlantedAdapter(FSDPAdapter):
    """An FSDPAdapter whose moves fail where a test arms them; each armed point raises once."""

    def __init__(self, *args: Any, rank: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rank = rank
        self.armed: set[str] = set()
        self.offload_stall_s = 0.0  # a rank that is slow in its offload (the others' barrier times out)
        self._reloading = False
        self.states_at_failure: list[str] | None = None  # each part's state when the planted failure raised

    def _fire(self, point: str) -> None:
        if point in self.armed:
            self.armed.discard(point)
            self.states_at_failure = [state.name for state in vars(self.part_states).values()]
            raise RuntimeError(f"planted: {point} failed on rank {self.rank}")

    def finish_offload(self, flight: Any) -> Any:
        # Inside the params' move, its copies issued: the optimizer state's copies are done and its storages freed,
        # then the move fails part-way (the params keep their device bytes, the optimizer state is offloaded).
        moved = super().finish_offload(flight)
        if self.offload_stall_s:
            time.sleep(self.offload_stall_s)  # test input: a rank stuck in its offload
        self._fire("offload")
        return moved

    def reload(self, **kwargs: Any) -> Any:
        self._reloading = True
        try:
            return super().reload(**kwargs)
        finally:
            self._reloading = False

    def _moved(self, named: Any) -> tuple[int, int]:
        # A move's bookkeeping, run once its copies are issued: a reload that fails here has regrown its storages.
        if self._reloading:
            self._fire("reload")
        return super()._moved(named)


class PlantedLink:
    """The sending rank's engine: the weights it got, and its memory as a real link keeps it (asleep, weights awake,
    serving); an armed step raises once, before it changes anything."""

    drives_memory = True

    def __init__(self) -> None:
        self.engine: dict[str, torch.Tensor] = {}
        self.memory = "asleep"
        self.armed: set[str] = set()

    def _step(self, name: str) -> None:
        if name in self.armed:
            self.armed.discard(name)
            raise RuntimeError(f"planted: the engine refused {name}")

    def wake_for_sync(self) -> None:
        self._step("wake_for_sync")
        if self.memory == "asleep":
            self.memory = "weights awake"

    def send(self, weights: Any) -> Any:
        got: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            got[name] = tensor.detach().clone()
            if len(got) == 2:
                self._step("send")  # part-way: two weights in
        self.engine = got
        return SimpleNamespace(bytes=sum(tensor.nbytes for tensor in got.values()))

    def wake_for_rollout(self) -> None:
        self._step("wake_for_rollout")
        self.memory = "serving"

    def sleep_for_training(self) -> None:
        self._step("sleep_for_training")
        self.memory = "asleep"


@dataclass
class Trainer:
    """One rank's trainer: FSDP2 model and optimizer after a step, the planted adapter, and its cycle."""

    rank: int
    world_size: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    adapter: PlantedAdapter
    link: PlantedLink | None
    cycle: RefitCycle
    full: dict[str, torch.Tensor]  # the gathered weights the engine must get
    state: dict[str, torch.Tensor]  # this rank's shards and optimizer state, to compare bit for bit

    def states(self) -> list[str]:
        return [state.name for state in vars(self.adapter.part_states).values()]

    def intact(self) -> bool:
        if self.states() != ["ON_DEVICE"] * 3:
            return False  # (reading offloaded tensors, 0 bytes on the device, would crash the process)
        now = local_state(self.model, self.optimizer)
        return sorted(now) == sorted(self.state) and all(bits_equal(now[key], self.state[key]) for key in self.state)

    def engine_exact(self) -> bool | None:
        if self.link is None:
            return None
        return sorted(self.link.engine) == sorted(self.full) and all(
            bits_equal(self.link.engine[n], t) for n, t in self.full.items()
        )


def trainer(rank: int, world_size: int, *, barrier_timeout_s: float = 60.0) -> Trainer:
    model, optimizer = build(world_size, fsdp=True, mixed_precision=False)
    train_step(model, optimizer, rank, 0)
    adapter = PlantedAdapter(model, optimizer, rank=rank)
    full = {name: tensor.clone() for name, tensor in adapter.named_weights()}  # (a collective: every rank)
    link = PlantedLink() if rank == 0 else None
    cycle = RefitCycle(adapter, link, barrier_timeout_s=barrier_timeout_s)
    return Trainer(rank, world_size, model, optimizer, adapter, link, cycle, full, local_state(model, optimizer))


def attempt(call: Callable[[], Any]) -> dict:
    """One call's outcome as data: the error's type, message, recovery, failures and cause (None when it succeeded)."""
    try:
        call()
        return {"error_type": None}
    except Exception as exc:  # noqa: BLE001 - reported to the test as data
        cause = exc.__cause__
        return {
            "error_type": type(exc).__name__,
            "error": str(exc),
            "recovery": getattr(exc, "recovery", None),
            "failures": getattr(exc, "failures", None),
            "cause_type": type(cause).__name__ if cause is not None else None,
            "cause": str(cause) if cause is not None else None,
        }


def recovered(t: Trainer, *, step: int, via: Callable[[], Any] | None = None) -> dict:
    """After the failure: the recovery call (if any), then a whole refit and resume; what each left."""
    out: dict = {}
    if via is not None:
        out["recovery_call"] = attempt(via)
        out["after_recovery"] = t.states()
    if t.link is not None:
        t.link.engine.clear()
    if _model_offloaded_on_some_ranks_only(t):  # refit() would hang in FSDP's gathers: report it instead
        out["next_refit"] = {"error_type": "not attempted: the model is offloaded on some ranks only"}
        out["final_states"] = t.states()
        return out
    out["next_refit"] = attempt(lambda: t.cycle.refit(step))
    out["next_refit_states"] = t.states()
    out["engine_exact"] = t.engine_exact()
    out["next_resume"] = attempt(lambda: t.cycle.resume(step))
    out["final_states"] = t.states()
    out["intact"] = t.intact()
    return out


def _model_offloaded_on_some_ranks_only(t: Trainer) -> bool:
    """Whether ranks disagree on the model part's state (on the trainer's own group: a test-side check)."""
    import torch.distributed as dist

    offloaded = t.adapter.part_states.model.name == "OFFLOADED"
    counts = torch.tensor([int(offloaded), int(not offloaded)])
    dist.all_reduce(counts)
    return bool(counts.min().item() > 0)


# -- one scenario per phase; the last rank fails unless the phase runs only on the sending rank (rank 0) -------


def sync_fails(rank: int, world_size: int) -> dict:
    """The sending rank's sync fails part-way (two weights in): nothing offloaded anywhere, nothing to call."""
    t = trainer(rank, world_size)
    if t.link is not None:
        t.link.armed.add("send")
    out = attempt(lambda: t.cycle.refit(1))
    out["states"] = t.states()
    out.update(recovered(t, step=2))
    return out


def offload_fails(rank: int, world_size: int) -> dict:
    """The last rank's offload fails part-way (its optimizer state already offloaded): every rank rolls back."""
    t = trainer(rank, world_size)
    if rank == world_size - 1:
        t.adapter.armed.add("offload")
    out = attempt(lambda: t.cycle.refit(1))
    out["states_at_failure"] = t.adapter.states_at_failure
    out["states"] = t.states()
    out["arena_held_bytes"] = t.adapter.arena.held_bytes  # every byte back on the device
    out["intact_after_rollback"] = t.intact()
    out["engine"] = t.link.memory if t.link is not None else None
    out.update(recovered(t, step=2))  # the next refit() as is: nothing to call
    return out


def rollback_fails(rank: int, world_size: int) -> dict:
    """The last rank's offload fails, then rank 0's rollback (its reload) fails part-way: every rank is told to
    call cycle.resume() on every rank, and that recovers."""
    t = trainer(rank, world_size)
    if rank == world_size - 1:
        t.adapter.armed.add("offload")
    if rank == 0:
        t.adapter.armed.add("reload")
    out = attempt(lambda: t.cycle.refit(1))
    out["states"] = t.states()
    out.update(recovered(t, step=2, via=lambda: t.cycle.resume(1)))
    return out


def kv_wake_fails(rank: int, world_size: int) -> dict:
    """The engine's KV cache does not wake (sending rank, after every rank offloaded): every rank stays offloaded
    and is told to call cycle.resume() on every rank."""
    t = trainer(rank, world_size)
    if t.link is not None:
        t.link.armed.add("wake_for_rollout")
    out = attempt(lambda: t.cycle.refit(1))
    out["states"] = t.states()
    out["engine"] = t.link.memory if t.link is not None else None
    out.update(recovered(t, step=2, via=lambda: t.cycle.resume(1)))
    return out


def engine_sleep_fails(rank: int, world_size: int) -> dict:
    """resume(): the engine does not go to sleep (sending rank): no rank reloads; resume() again recovers."""
    t = trainer(rank, world_size)
    t.cycle.refit(1)
    if t.link is not None:
        t.link.armed.add("sleep_for_training")
    out = attempt(lambda: t.cycle.resume(1))
    out["states"] = t.states()
    out.update(recovered(t, step=2, via=lambda: t.cycle.resume(1)))
    return out


def reload_fails(rank: int, world_size: int) -> dict:
    """resume(): the last rank's reload fails part-way: it stays offloaded, the others are back; resume() again."""
    t = trainer(rank, world_size)
    t.cycle.refit(1)
    if rank == world_size - 1:
        t.adapter.armed.add("reload")
    out = attempt(lambda: t.cycle.resume(1))
    out["states"] = t.states()
    out.update(recovered(t, step=2, via=lambda: t.cycle.resume(1)))
    return out


def deferred_fails(rank: int, world_size: int) -> dict:
    """resume(defer_optimizer=True): the last rank's deferred optimizer copies fail after every rank returned. Only
    that rank learns it (at its step); its adapter.reload() recovers, and the next refit() works."""
    t = trainer(rank, world_size)
    t.cycle.refit(1)
    if rank == world_size - 1:

        def fail(name: str) -> None:
            t.adapter._deferred_before_copy = None  # once
            raise RuntimeError(f"planted: deferred copy of {name} failed on rank {rank}")

        t.adapter._deferred_before_copy = fail
    out = attempt(lambda: t.cycle.resume(1, defer_optimizer=True))
    out["step"] = attempt(t.adapter.wait_deferred)  # what the optimizer's step waits for
    out["states"] = t.states()
    out.update(recovered(t, step=2, via=t.adapter.reload if rank == world_size - 1 else None))
    return out


def async_twins(rank: int, world_size: int) -> dict:
    """arefit()/aresume(): the same outcomes as refit()/resume() (the last rank's offload, then its reload, fail)."""
    t = trainer(rank, world_size)

    async def main() -> dict:
        out: dict = {}
        if rank == world_size - 1:
            t.adapter.armed.add("offload")
        out["arefit"] = await _attempt_async(t.cycle.arefit(1))
        out["arefit_states"] = t.states()
        if _model_offloaded_on_some_ranks_only(t):  # refit() would hang in FSDP's gathers: report it instead
            out["arefit_again"] = {"error_type": "not attempted: the model is offloaded on some ranks only"}
            return out
        out["arefit_again"] = await _attempt_async(t.cycle.arefit(2))  # rolled back: works as is
        if rank == world_size - 1:
            t.adapter.armed.add("reload")
        out["aresume"] = await _attempt_async(t.cycle.aresume(2))
        out["aresume_states"] = t.states()
        out["aresume_again"] = await _attempt_async(t.cycle.aresume(2))
        out["final_states"] = t.states()
        out["engine_exact"] = t.engine_exact()
        out["intact"] = t.intact()
        return out

    return asyncio.run(main())


async def _attempt_async(call: Any) -> dict:
    try:
        await call
        return {"error_type": None}
    except Exception as exc:  # noqa: BLE001 - reported to the test as data
        return {"error_type": type(exc).__name__, "error": str(exc), "recovery": getattr(exc, "recovery", None)}


def offload_barrier_times_out(rank: int, world_size: int, barrier_timeout_s: float, stall_s: float) -> dict:
    """The last rank is stuck in its offload past barrier_timeout_s: every rank gives up on the offload's exchange
    (the late one when it arrives), reloads what it offloaded, and is told to make a new RefitCycle on every rank."""
    t = trainer(rank, world_size, barrier_timeout_s=barrier_timeout_s)
    if rank == world_size - 1:
        t.adapter.offload_stall_s = stall_s
    out = attempt(lambda: t.cycle.refit(1))
    out["states"] = t.states()
    t.adapter.offload_stall_s = 0.0
    t.cycle.close()
    t.cycle = RefitCycle(t.adapter, t.link, barrier_timeout_s=60.0)  # the recovery the error names
    out.update(recovered(t, step=2))
    return out


SCENARIOS: dict[str, Callable[..., dict]] = {
    "sync_fails": sync_fails,
    "offload_fails": offload_fails,
    "rollback_fails": rollback_fails,
    "kv_wake_fails": kv_wake_fails,
    "engine_sleep_fails": engine_sleep_fails,
    "reload_fails": reload_fails,
    "deferred_fails": deferred_fails,
    "async_twins": async_twins,
}


def every_phase(rank: int, world_size: int, names: list[str], barrier_timeout_s: float, stall_s: float) -> dict:
    """The scenarios ``names``, one after another in one world (spawning ranks costs seconds each), each with fresh
    models and cycles; a scenario that raises is recorded as its traceback so that the others still report. The one
    that spends its cycle's group runs last."""
    results: dict = {}
    for name in names:
        try:
            if name == "offload_barrier_times_out":
                results[name] = offload_barrier_times_out(rank, world_size, barrier_timeout_s, stall_s)
            else:
                results[name] = SCENARIOS[name](rank, world_size)
        except Exception:  # noqa: BLE001 - reported to the test as data
            results[name] = {"crashed": traceback.format_exc()}
    return results
