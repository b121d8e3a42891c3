"""Rank functions for multi-rank refit tests (spawned by tests.helpers.world.run_world)."""

from __future__ import annotations

import threading
import uuid

import torch

from refitkit.engines import DeviceState
from refitkit.engines.fsdp import FSDPAdapter
from refitkit.refit import RefitCycle
from refitkit.transfer import BucketedWeightReceiver, BucketedWeightSender
from tests.engines.fsdp.ranks import build, train_step
from tests.helpers.bits import bits_equal
from tests.helpers.world import child_env


def refit_two_ranks(rank: int, world_size: int) -> dict:
    """FSDP2 over gloo: rank 0 streams the gathered weights to a receiver, rank 1 only joins the gathers."""
    model, optimizer = build(world_size, fsdp=True, mixed_precision=False)
    train_step(model, optimizer, rank, 0)
    adapter = FSDPAdapter(model, optimizer)
    full = {name: tensor.clone() for name, tensor in adapter.named_weights()}  # what inference must get
    received: dict[str, torch.Tensor] = {}
    sender = peer = None
    if rank == 0:
        endpoint = f"refit2-{uuid.uuid4().hex[:8]}"
        sender = BucketedWeightSender(endpoint, bucket_bytes=64 * 1024, transport="shm", timeout_s=30.0, direct=False)

        def receive() -> None:
            def load(batch, is_last):
                for name, tensor in batch:
                    received[name] = tensor.clone()

            BucketedWeightReceiver(endpoint, "cpu", timeout_s=30.0).receive(load)

        peer = threading.Thread(target=receive, daemon=True)
        peer.start()
    cycle = RefitCycle(adapter, sender, barrier_timeout_s=60.0)
    report = cycle.refit(step=1)
    offloaded = adapter.state is DeviceState.OFFLOADED and adapter.state_bytes().device_bytes == 0
    cycle.resume(step=1)
    if peer is not None:
        peer.join(30.0)
        sender.close()
    loss = train_step(model, optimizer, rank, 1)
    return {
        "phases": [p.name for p in report.phases],
        "sync_bytes": report.phase("sync_weights").bytes,
        "offloaded": offloaded,
        "received_equal": sorted(received) == sorted(full) and all(bits_equal(received[n], full[n]) for n in full)
        if rank == 0
        else None,
        "loss_finite": bool(torch.isfinite(torch.tensor(loss))),
    }


# --- failures across ranks (items 3 and 4 of the fail-safe issue) ---------------------------------


def _world_all_reduce(value: float) -> float:
    """A collective on the trainer's own (default) group: it must still work after our failures."""
    import torch.distributed as dist

    tensor = torch.tensor([value])
    dist.all_reduce(tensor)
    return float(tensor.item())


def attempt_refit(cycle: RefitCycle, *, step: int) -> dict:
    """One refit() as data: the error's type, message and failed ranks (None when it succeeded), and its seconds."""
    import time

    start = time.monotonic()
    try:
        cycle.refit(step=step)
        outcome: dict = {"error_type": None}
    except Exception as exc:
        outcome = {
            "error_type": type(exc).__name__,
            "error": str(exc),
            "failures": getattr(exc, "failures", None),
            "recovery": getattr(exc, "recovery", None),
        }
    outcome["seconds"] = time.monotonic() - start
    return outcome


def sender_loses_its_receiver(rank: int, world_size: int, timeout_s: float, barrier_timeout_s: float) -> dict:
    """FSDP2 over gloo: rank 0 streams to an endpoint no receiver ever connects to; rank 1 joins the gathers.

    Every rank must end in a refitkit error within the bounds, with nothing offloaded, and the FSDP
    group must still train afterwards.
    """

    model, optimizer = build(world_size, fsdp=True, mixed_precision=False)
    train_step(model, optimizer, rank, 0)
    adapter = FSDPAdapter(model, optimizer)
    sender = None
    if rank == 0:
        sender = BucketedWeightSender(
            f"lost-{uuid.uuid4().hex[:8]}", transport="shm", timeout_s=timeout_s, direct=False
        )
    cycle = RefitCycle(adapter, sender, barrier_timeout_s=barrier_timeout_s)
    outcome = attempt_refit(cycle, step=1)
    if sender is not None:
        sender.close()
    outcome["on_device"] = adapter.state is DeviceState.ON_DEVICE
    outcome["loss_after"] = train_step(model, optimizer, rank, 1)  # FSDP collectives still work
    outcome["all_reduce"] = _world_all_reduce(rank + 1.0)
    return outcome


class _Plain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.arange(64, dtype=torch.float32).reshape(8, 8))


def rank_misses_the_barrier(rank: int, world_size: int, barrier_timeout_s: float, late_s: float) -> dict:
    """Rank 1 makes its cycle but never calls refit() (it sleeps, then uses the default group);
    rank 0 must get BarrierTimeout within the bound and keep a usable default group."""
    import time

    model = _Plain()
    adapter = FSDPAdapter(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cycle = RefitCycle(adapter, None, barrier_timeout_s=barrier_timeout_s)
    if rank == 1:
        time.sleep(late_s)
        return {"all_reduce": _world_all_reduce(rank + 1.0)}
    outcome = attempt_refit(cycle, step=1)
    outcome["all_reduce"] = _world_all_reduce(rank + 1.0)
    try:  # the cycle's own group is spent after a timeout, and says so at once
        cycle.refit(step=2)
    except Exception as exc:
        outcome["second_error"] = f"{type(exc).__name__}: {exc}"
    return outcome


def late_rank(rank: int, world_size: int, late_s: float) -> dict:
    """Rank 1 starts its refit ``late_s`` later; rank 0's refit() must return only after rank 1 offloaded."""
    import time

    model = _Plain()
    adapter = FSDPAdapter(model, torch.optim.SGD(model.parameters(), lr=0.1))
    offloaded_at: list[float] = []
    cycle = RefitCycle(
        adapter,
        None,
        barrier_timeout_s=60.0,
        on_phase=lambda phase: offloaded_at.append(time.time()) if phase == "flush_device" else None,
    )
    if rank == 1:
        time.sleep(late_s)
    report = cycle.refit(step=1)
    returned_at = time.time()
    cycle.resume(step=1)
    return {"offloaded_at": offloaded_at[0], "returned_at": returned_at, "refit_s": report.seconds}


def offload_fails_on_one_rank(rank: int, world_size: int, barrier_timeout_s: float) -> dict:
    """Rank 1's offload is refused (a param on the meta device); every rank raises at once, rolled back."""

    model = _Plain()
    if rank == 1:
        model.weight = torch.nn.Parameter(torch.empty(8, 8, device="meta"))  # offload refuses it, moving nothing
    adapter = FSDPAdapter(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cycle = RefitCycle(adapter, None, barrier_timeout_s=barrier_timeout_s)
    outcome = attempt_refit(cycle, step=1)
    outcome["state"] = adapter.state.name
    try:  # nothing to recover (a no-op reload on every rank), and resume() says so by working
        cycle.resume(step=1)
        outcome["resumed"] = True
    except Exception as exc:
        outcome["resumed"] = f"{type(exc).__name__}: {exc}"
    return outcome


def async_refit(rank: int, world_size: int) -> dict:
    """arefit/aresume and abounded_barrier leave the event loop free while the collectives wait."""
    import asyncio

    from refitkit.refit import abounded_barrier

    model = _Plain()
    adapter = FSDPAdapter(model, torch.optim.SGD(model.parameters(), lr=0.1))
    cycle = RefitCycle(adapter, None, barrier_timeout_s=60.0)

    async def main() -> dict:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        tick_task = asyncio.create_task(ticker())
        if rank == 1:
            await asyncio.sleep(1.0)  # rank 0 waits in the collectives meanwhile: its loop must keep ticking
        report = await cycle.arefit(1)
        state = adapter.state.name
        await cycle.aresume(1)
        waited = await abounded_barrier(timeout_s=30.0, phase="async")
        done.set()
        await tick_task
        return {"ticks": ticks, "state": state, "phases": [p.name for p in report.phases], "waited": waited}

    return asyncio.run(main())


def failure_scenarios(rank: int, world_size: int, timeout_s: float, barrier_timeout_s: float, late_s: float) -> dict:
    """The CPU scenarios of tests/refit/test_failures.py, one after another in one world (spawning ranks
    costs seconds each); each gets fresh cycles, and the one that spends its cycle's group comes last.
    A scenario that raises is recorded as its traceback, so the others still run and report."""
    import traceback

    scenarios = {
        "sender_loses_its_receiver": lambda: sender_loses_its_receiver(rank, world_size, timeout_s, barrier_timeout_s),
        "offload_fails_on_one_rank": lambda: offload_fails_on_one_rank(rank, world_size, barrier_timeout_s),
        "late_rank": lambda: late_rank(rank, world_size, late_s),
        "async_refit": lambda: async_refit(rank, world_size),
        "rank_misses_the_barrier": lambda: rank_misses_the_barrier(rank, world_size, 1.5, 2 * late_s),
    }
    results: dict = {}
    for name, scenario in scenarios.items():
        try:
            results[name] = scenario()
        except Exception:
            results[name] = {"crashed": traceback.format_exc()}
    return results


def cuda_ipc_receiver_killed_mid_sync(rank: int, world_size: int, timeout_s: float, barrier_timeout_s: float) -> dict:
    """Two trainer ranks on one GPU (gloo only for the cycle's group): rank 0 streams over CUDA IPC to a receiver
    process that SIGKILLs itself at its second bucket. Every rank must raise within the bounds, the sender's
    GPU bucket must be freed, nothing offloaded, and the next refit to a fresh receiver must work."""
    import subprocess
    import sys
    import time

    import torch.distributed as dist

    from tests.transfer.harness import assert_device_memory_back, device_free_bytes

    device = torch.device("cuda", 0)
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(8))).to(device)  # 8 x 4 MiB
    adapter = FSDPAdapter(model, torch.optim.SGD(model.parameters(), lr=0.1))
    endpoint = f"ipc-kill-{uuid.uuid4().hex[:8]}"
    sender = (
        BucketedWeightSender(endpoint, bucket_bytes=16 << 20, transport="cuda_ipc", timeout_s=timeout_s, direct=False)
        if rank == 0
        else None
    )
    cycle = RefitCycle(adapter, sender, barrier_timeout_s=barrier_timeout_s)

    def receiver(mode: str, arg: object) -> subprocess.Popen:
        # a plain subprocess: rank processes are daemonic and may not have multiprocessing children
        code = (
            "import json, sys, torch; from tests.transfer.peers import _run_session; torch.zeros(1, device='cuda:0'); "
            "print('starting', flush=True); "
            f"r = _run_session({endpoint!r}, 'cuda:0', 30.0, {mode!r}, {arg!r}, {{}}); print(json.dumps(r['calls']))"
        )
        process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=child_env())
        if process.stdout is None or process.stdout.readline().strip() != "starting":
            raise AssertionError("receiver process did not start")
        return process

    # One whole sync before the baseline. The kernels a sync launches (the bucket's batched copy among them) are
    # loaded on first use into device memory the driver keeps for the process's life (lazy module loading): without
    # this the sender's first sync, killed or not, leaves that 2 MiB behind and the check below cannot tell it from
    # a leaked page.
    before_warm_up = device_free_bytes()
    warm = receiver("collect", None) if rank == 0 else None
    cycle.refit(step=0)
    cycle.resume(step=0)
    if warm is not None:
        warm.communicate(timeout=30)
        assert warm.returncode == 0, f"the warm-up receiver exited with {warm.returncode}"
    deadline = time.monotonic() + 10.0
    while before_warm_up - device_free_bytes() > (64 << 20) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling the driver's teardown of the exited receiver's context, not our own code
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    dist.barrier()  # both ranks warm, the receiver gone: the device's free memory is this test's baseline
    baseline = device_free_bytes()
    dist.barrier()

    killed = receiver("kill", 2) if rank == 0 else None
    outcome = attempt_refit(cycle, step=1)
    outcome["on_device"] = adapter.state is DeviceState.ON_DEVICE
    if killed is not None:
        outcome["receiver_exit"] = killed.wait(30)
        assert_device_memory_back(baseline, "after the receiver was killed mid-sync", settle_s=10.0)
        outcome["bucket_freed"] = True
    dist.barrier()
    fresh = receiver("collect", None) if rank == 0 else None
    report = cycle.refit(step=2)  # the same cycle (its group is fine: no exchange timed out) to a fresh receiver
    outcome["second_offloaded"] = adapter.state is DeviceState.OFFLOADED and report.phase("sync_weights").bytes == (
        8 * 1024 * 1024 * 4 if rank == 0 else 0
    )
    cycle.resume(step=2)
    if fresh is not None:
        output, _ = fresh.communicate(timeout=30)
        outcome["fresh_ok"] = fresh.returncode == 0 and output.strip().endswith("true]]")  # its last bucket came
        sender.close()
    return outcome


def rank_never_calls_refit_with_fsdp(rank: int, world_size: int, barrier_timeout_s: float, late_s: float) -> dict:
    """FSDP2 over gloo: rank 1 never calls refit() (it stays ``late_s`` in its 'step', then uses the default
    group). Rank 0 must get BarrierTimeout within barrier_timeout_s, before entering FSDP's all-gathers
    (where rank 1 would never join), and both keep a usable default group."""
    import time

    model, optimizer = build(world_size, fsdp=True, mixed_precision=False)
    train_step(model, optimizer, rank, 0)
    adapter = FSDPAdapter(model, optimizer)
    cycle = RefitCycle(adapter, None, barrier_timeout_s=barrier_timeout_s)
    if rank == 1:
        time.sleep(late_s)  # test input: a rank stuck in its own step
        return {"all_reduce": _world_all_reduce(rank + 1.0)}
    outcome = attempt_refit(cycle, step=1)
    outcome["on_device"] = adapter.state is DeviceState.ON_DEVICE
    outcome["all_reduce"] = _world_all_reduce(rank + 1.0)
    return outcome
