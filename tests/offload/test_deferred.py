"""Deferred optimizer reload: reload returns after the params, the optimizer's step waits for its state.

CPU runs the same protocol as CUDA (pending state, step pre-hook, bounded wait, failure at the
step); the copies run in the deferred reload's worker thread, which a test holds back with a
``threading.Event`` through the adapter's ``_deferred_before_copy`` injection point.
"""

from __future__ import annotations

import threading
import traceback

import pytest
import torch

from refitkit.engines import DeviceState
from refitkit.engines.fsdp import FSDPAdapter
from refitkit.errors import DeferredTimeout, InvalidInput, RefitError
from refitkit.offload import HostArena, offload_tensors
from refitkit.offload.deferred import ArrivalState, reload_deferred
from tests.helpers.bits import bits_equal

pytestmark = pytest.mark.timeout(120)

GATE_S = 30.0  # the longest a held-back copy waits for its gate (a bound, never reached when the test passes)


def make(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for index, state in enumerate(optimizer.state.values()):
        out.update({f"o.{index}.{k}": v.clone() for k, v in state.items()})
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(bits_equal(a[k], b[k]) for k in a)


def serial_run() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference: 4 steps with a plain offload + reload between steps 2 and 3."""
    model, optimizer = make()
    losses = [train_step(model, optimizer, s) for s in range(2)]
    adapter = FSDPAdapter(model, optimizer)
    adapter.offload()
    adapter.reload()
    losses += [train_step(model, optimizer, s) for s in range(2, 4)]
    return losses, snapshot(model, optimizer)


def offloaded_after_two_steps() -> tuple[torch.nn.Module, torch.optim.Optimizer, FSDPAdapter, list[float]]:
    model, optimizer = make()
    losses = [train_step(model, optimizer, s) for s in range(2)]
    adapter = FSDPAdapter(model, optimizer)
    adapter.offload()
    return model, optimizer, adapter, losses


def optimizer_device_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.untyped_storage().nbytes() for s in optimizer.state.values() for v in s.values())


def test_deferred_reload_trains_bit_identical_to_the_serial_path():
    reference_losses, reference = serial_run()
    model, optimizer, adapter, losses = offloaded_after_two_steps()
    held = adapter.arena.held_bytes
    move = adapter.reload(defer_optimizer=True)
    assert adapter.part_states.model is DeviceState.ON_DEVICE and adapter.part_states.grad is DeviceState.ON_DEVICE
    assert adapter.part_states.optimizer is DeviceState.ARRIVING  # until a step (or a call) waited for it
    assert adapter.state is DeviceState.ON_DEVICE  # a train step can run
    assert move.optimizer.bytes > 0 and move.total.bytes == move.model.bytes == held - move.optimizer.bytes
    assert len(optimizer._optimizer_step_pre_hooks) == 1
    losses += [train_step(model, optimizer, s) for s in range(2, 4)]
    assert adapter.part_states.optimizer is DeviceState.ON_DEVICE
    assert len(optimizer._optimizer_step_pre_hooks) == 0  # the hook removed itself
    assert adapter.arena.held_bytes == 0
    assert losses == reference_losses
    assert same(snapshot(model, optimizer), reference)


def test_a_step_that_starts_before_the_copies_finished_waits_and_is_exact():
    reference_losses, reference = serial_run()
    model, optimizer, adapter, losses = offloaded_after_two_steps()
    gate = threading.Event()
    adapter._deferred_before_copy = lambda name: gate.wait(GATE_S)
    seen: dict[str, object] = {}

    def at_step_start(opt, args, kwargs):  # registered first, so it runs before the adapter's hook
        if not seen:
            seen["optimizer_bytes"] = optimizer_device_bytes(optimizer)
            seen["state"] = adapter._gate.deferred.state
            gate.set()  # only now may the copies run: the adapter's hook must wait for them

    mine = optimizer.register_step_pre_hook(at_step_start)
    adapter.reload(defer_optimizer=True)
    losses += [train_step(model, optimizer, s) for s in range(2, 4)]  # forward + backward ran with the copies held
    mine.remove()
    assert seen == {"optimizer_bytes": 0, "state": ArrivalState.COPYING}  # the step really started early
    assert adapter.part_states.optimizer is DeviceState.ON_DEVICE
    assert losses == reference_losses
    assert same(snapshot(model, optimizer), reference)


def test_a_failed_deferred_reload_raises_at_the_step_naming_the_tensor_and_loses_nothing():
    reference_losses, reference = serial_run()
    model, optimizer, adapter, losses = offloaded_after_two_steps()
    held = adapter.arena.held_bytes
    victim = "optimizer.param_groups[0].params[2].exp_avg"

    def fail_on(name: str) -> None:
        if name == victim:
            raise RuntimeError("injected: out of device memory")

    adapter._deferred_before_copy = fail_on
    adapter.reload(defer_optimizer=True)
    for _ in range(2):  # every step raises while the state is not there; none runs on freed state
        with pytest.raises(RefitError, match=r"deferred reload of FSDPAdapter's optimizer state failed") as info:
            train_step(model, optimizer, 2)
        assert repr(victim) in str(info.value) and "injected: out of device memory" in str(info.value)
        assert "call reload() again" in str(info.value)
    assert adapter.part_states.optimizer is DeviceState.OFFLOADED
    assert optimizer_device_bytes(optimizer) == 0  # what was regrown was freed again
    assert adapter.arena.held_bytes == held - adapter.state_bytes().model.device_bytes  # the optimizer's bytes stayed
    model.zero_grad(set_to_none=True)  # the failed attempts' backward passes left grads behind
    adapter._deferred_before_copy = None
    adapter.reload()  # the retry rule of a plain reload
    assert len(optimizer._optimizer_step_pre_hooks) == 0
    losses += [train_step(model, optimizer, s) for s in range(2, 4)]
    assert losses == reference_losses
    assert same(snapshot(model, optimizer), reference)


def test_a_failed_deferred_reload_surfaces_at_the_next_adapter_call_and_can_be_retried_deferred():
    reference_losses, reference = serial_run()
    model, optimizer, adapter, losses = offloaded_after_two_steps()
    adapter._deferred_before_copy = lambda name: (_ for _ in ()).throw(RuntimeError("injected copy error"))
    adapter.reload(defer_optimizer=True)
    with pytest.raises(
        RefitError, match=r"'optimizer\.param_groups\[0\]\.params\[0\]\.(step|exp_avg)'.*injected copy error"
    ):
        adapter.offload(optimizer=False)
    adapter.offload(optimizer=False)  # the failure was raised once; the adapter works on
    assert adapter.part_states == type(adapter.part_states)(
        DeviceState.OFFLOADED, DeviceState.OFFLOADED, DeviceState.OFFLOADED
    )
    adapter._deferred_before_copy = None
    adapter.reload(defer_optimizer=True)
    losses += [train_step(model, optimizer, s) for s in range(2, 4)]
    assert losses == reference_losses
    assert same(snapshot(model, optimizer), reference)


def test_a_step_waits_at_most_deferred_timeout_s_then_a_later_step_still_gets_the_state():
    reference_losses, reference = serial_run()
    model, optimizer, adapter, losses = offloaded_after_two_steps()
    gate = threading.Event()
    adapter._deferred_before_copy = lambda name: gate.wait(GATE_S)
    adapter.reload(defer_optimizer=True, deferred_timeout_s=0.2)
    with pytest.raises(DeferredTimeout, match=r"did not arrive within deferred_timeout_s=0\.2 s") as info:
        optimizer.step()  # no grads yet: the wait comes before anything is read
    assert "raise deferred_timeout_s" in str(info.value)
    assert adapter.part_states.optimizer is DeviceState.ARRIVING
    gate.set()
    losses += [train_step(model, optimizer, s) for s in range(2, 4)]
    assert losses == reference_losses
    assert same(snapshot(model, optimizer), reference)


def test_offload_while_the_state_is_arriving_waits_for_it_first():
    model, optimizer, adapter, _ = offloaded_after_two_steps()
    adapter.reload()
    before = snapshot(model, optimizer)
    adapter.offload()
    gate = threading.Event()
    adapter._deferred_before_copy = lambda name: gate.wait(GATE_S)
    adapter.reload(defer_optimizer=True)
    gate.set()
    adapter.offload()  # must take the arriving optimizer state along, not skip it
    assert adapter.part_states.optimizer is DeviceState.OFFLOADED
    assert adapter.state_bytes().device_bytes == 0
    assert len(optimizer._optimizer_step_pre_hooks) == 0
    adapter.reload()
    assert same(snapshot(model, optimizer), before)


def test_an_overlapped_offload_started_while_the_state_is_arriving_waits_for_it_first():
    """RefitCycle(overlap=True) starts the optimizer's copies before the sync: right after a deferred
    resume (no step in between) they must copy the state that arrived, not skip or read it half-copied."""
    model, optimizer, adapter, _ = offloaded_after_two_steps()
    adapter.reload()
    before = snapshot(model, optimizer)
    adapter.offload()
    gate = threading.Event()
    adapter._deferred_before_copy = lambda name: gate.wait(GATE_S)
    adapter.reload(defer_optimizer=True)
    threading.Timer(0.2, gate.set).start()  # the copies run only after begin_offload was called
    flight = adapter.begin_offload()
    assert "optimizer" in flight.parts
    adapter.finish_offload(flight)
    adapter.offload()  # the params
    assert adapter.part_states.optimizer is DeviceState.OFFLOADED
    assert adapter.state_bytes().device_bytes == 0
    assert len(optimizer._optimizer_step_pre_hooks) == 0
    adapter.reload()
    assert same(snapshot(model, optimizer), before)


def test_deferring_needs_an_optimizer_to_wait_in_and_a_valid_timeout():
    model, _ = make()
    adapter = FSDPAdapter(model)
    adapter.offload()
    with pytest.raises(InvalidInput, match="no optimizer whose step could wait"):
        adapter.reload(defer_optimizer=True)
    assert adapter.state is DeviceState.OFFLOADED  # nothing moved
    with pytest.raises(InvalidInput, match="deferred_timeout_s=0"):
        adapter.reload(defer_optimizer=True, deferred_timeout_s=0)
    with pytest.raises(InvalidInput, match="defer_optimizer= must be a bool"):
        adapter.reload(defer_optimizer="yes")
    adapter.reload()
    assert adapter.state is DeviceState.ON_DEVICE


def test_reload_deferred_restores_bytes_and_wait_is_idempotent():
    tensors = [torch.arange(n, dtype=torch.float32) * 1.5 for n in (3, 100, 7)]
    originals = [t.clone() for t in tensors]
    arena = HostArena()
    offload_tensors(tensors, arena)
    deferred = reload_deferred(tensors, arena, timeout_s=30.0)
    stats = deferred.wait()
    assert stats.bytes == sum(t.numel() * 4 for t in originals) and stats.storages == 3
    assert deferred.state is ArrivalState.ARRIVED and deferred.wait().bytes == 0
    assert all(bits_equal(t, o) for t, o in zip(tensors, originals))
    assert arena.held_bytes == 0


def test_aresume_defers_from_its_worker_thread_and_the_step_in_the_caller_waits():
    import asyncio

    from refitkit.refit import RefitCycle

    reference_losses, reference = serial_run()
    model, optimizer = make()
    losses = [train_step(model, optimizer, s) for s in range(2)]
    adapter = FSDPAdapter(model, optimizer)
    with RefitCycle(adapter, None, barrier_timeout_s=30.0) as cycle:
        cycle.refit(step=1)
        report = asyncio.run(cycle.aresume(1, defer_optimizer=True))
    assert report.phase("reload").bytes == adapter.state_bytes().model.device_bytes  # params only on return
    assert adapter.part_states.optimizer is DeviceState.ARRIVING
    losses += [train_step(model, optimizer, s) for s in range(2, 4)]
    assert adapter.part_states.optimizer is DeviceState.ON_DEVICE
    assert losses == reference_losses
    assert same(snapshot(model, optimizer), reference)


def _failing_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> list[int]:
    """The length of each failing step's formatted error (message, notes, chain and traceback)."""
    sizes = []
    for _ in range(steps):
        try:
            train_step(model, optimizer, 2)
        except RefitError as error:
            sizes.append(len("".join(traceback.format_exception(error))))
    return sizes


def test_a_failed_deferred_reload_and_its_failing_steps_leave_no_reference_cycle_and_the_error_does_not_grow():
    from refitkit.watchdog import CycleAudit

    model, optimizer, adapter, _ = offloaded_after_two_steps()

    def fail(name: str) -> None:
        raise RuntimeError("injected: out of device memory")

    with CycleAudit() as audit:
        adapter._deferred_before_copy = fail
        adapter.reload(defer_optimizer=True)
        sizes = _failing_steps(model, optimizer, 4)
        model.zero_grad(set_to_none=True)  # the failed attempts' backward passes left grads behind
        adapter._deferred_before_copy = None
        adapter.reload()  # the retry drops the failed reload's gate: nothing may keep it alive in a cycle
    assert audit.report is not None and audit.report.clean, audit.report.summary()
    assert len(sizes) == 4 and len(set(sizes)) == 1, f"the error grows with every raise: {sizes}"
    train_step(model, optimizer, 2)  # the retried state is whole


def test_a_failed_reload_deferred_raises_a_fresh_error_naming_the_cause_each_wait():
    from refitkit.watchdog import CycleAudit

    tensors = [torch.arange(n, dtype=torch.float32) for n in (3, 5)]
    arena = HostArena()
    offload_tensors(tensors, arena)

    def fail(name: str) -> None:
        raise RuntimeError("injected copy error")

    with CycleAudit() as audit:
        deferred = reload_deferred(tensors, arena, timeout_s=30.0, what="two tensors", before_copy=fail)
        texts = []
        for _ in range(3):
            try:
                deferred.wait()
            except RefitError as error:
                texts.append("".join(traceback.format_exception(error)))
        assert deferred.state is ArrivalState.FAILED
        del deferred
    assert audit.report is not None and audit.report.clean, audit.report.summary()
    assert len(texts) == 3 and len(set(texts)) == 1, [len(t) for t in texts]
    assert "deferred reload of two tensors failed" in texts[0] and "RuntimeError: injected copy error" in texts[0]
