"""Deferred optimizer reload on a GPU: copies on a side stream, the step's stream waits for its event.

The side stream is held back with a GPU spin kernel (``torch.cuda._sleep``) queued before the
copies, and the memory the regrown storages come from is poisoned with NaN first: a step that did
not wait for the side stream's event would read NaN (or stale) moments and differ from the serial path.
"""

from __future__ import annotations

import pytest
import torch

from refitkit.engines import DeviceState
from refitkit.engines.fsdp import FSDPAdapter
from refitkit.errors import RefitError
from refitkit.offload import flush_device
from tests.helpers.bits import bits_equal

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(180)]

SPIN_CYCLES = 200_000_000  # ~0.1 s of one SM at H200 clocks: far longer than launching the step's kernels
WIDTH = 1024  # 4 MiB fp32 weights: their state comes from the large pool, where the poison was freed


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(3))).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    x = torch.randn(64, WIDTH, device="cuda", generator=g)
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"p.{n}": p.detach().cpu() for n, p in model.named_parameters()}
    for index, state in enumerate(optimizer.state.values()):
        out.update({f"o.{index}.{k}": v.detach().cpu() for k, v in state.items()})
    return out


def run(defer: bool, *, spin: bool = False, fail_on: str | None = None) -> dict:
    model, optimizer = make()
    losses = [train_step(model, optimizer, s) for s in range(2)]
    adapter = FSDPAdapter(model, optimizer)
    adapter.offload()
    flush_device()
    poisoned: list[bool] = []

    def before_copy(name: str) -> None:  # runs in the worker, with the side stream current
        if not poisoned:
            poisoned.append(True)
            side = torch.cuda.current_stream()
            nbytes = adapter.arena.held_bytes
            # freed at once, back to the side stream's pool: the regrown storages are carved from it
            torch.full((nbytes // 4 + WIDTH * WIDTH,), float("nan"), device="cuda")
            if spin:
                torch.cuda._sleep(SPIN_CYCLES)  # the copies queue behind this on the side stream
            assert side != torch.cuda.default_stream()  # the copies run on the side stream
        if name == fail_on:
            raise RuntimeError("injected regrow failure")

    adapter._deferred_before_copy = before_copy
    out: dict = {}
    move = adapter.reload(defer_optimizer=defer)
    out["arriving"] = adapter.part_states.optimizer is DeviceState.ARRIVING
    out["returned_bytes"] = move.total.bytes
    try:
        losses += [train_step(model, optimizer, s) for s in range(2, 4)]
    except RefitError as error:
        out["error"] = str(error)
        out["state_after_failure"] = adapter.part_states.optimizer
        out["optimizer_device_bytes"] = adapter.state_bytes().optimizer.device_bytes
        adapter._deferred_before_copy = None
        optimizer.zero_grad(set_to_none=True)
        adapter.reload()
        losses += [train_step(model, optimizer, s) for s in range(2, 4)]
    torch.cuda.synchronize()
    out["losses"] = losses
    out["state"] = snapshot(model, optimizer)
    out["hooks_left"] = len(optimizer._optimizer_step_pre_hooks)
    return out


def test_a_step_queued_while_the_side_stream_copies_is_ordered_after_them_and_exact():
    serial = run(False)
    deferred = run(True, spin=True)
    assert deferred["arriving"] and deferred["hooks_left"] == 0
    assert deferred["returned_bytes"] == sum(p.numel() * 4 for p in make()[0].parameters())  # params only
    assert deferred["losses"] == serial["losses"]
    assert sorted(deferred["state"]) == sorted(serial["state"])
    assert all(bits_equal(deferred["state"][k], serial["state"][k]) for k in serial["state"])


def test_a_deferred_reload_that_fails_on_the_gpu_raises_at_the_step_and_the_retry_is_exact():
    serial = run(False)
    victim = "optimizer.param_groups[0].params[3].exp_avg"
    failed = run(True, spin=True, fail_on=victim)
    assert repr(victim) in failed["error"] and "injected regrow failure" in failed["error"]
    assert failed["state_after_failure"] is DeviceState.OFFLOADED and failed["optimizer_device_bytes"] == 0
    assert failed["losses"] == serial["losses"]
    assert all(bits_equal(failed["state"][k], serial["state"][k]) for k in serial["state"])


def test_releasing_the_arena_while_deferred_copies_are_queued_waits_for_them():
    """wait_deferred() frees the slots once the copies are queued (the host does not wait); releasing the
    pinned arena right then must not unregister and free pages the side stream has yet to read."""
    model, optimizer = make()
    for s in range(2):
        train_step(model, optimizer, s)
    expected = snapshot(model, optimizer)
    adapter = FSDPAdapter(model, optimizer)
    adapter.offload()
    flush_device()
    spun: list[bool] = []

    def before_copy(name: str) -> None:  # in the worker, with the side stream current
        if not spun:
            spun.append(True)
            torch.cuda._sleep(4 * SPIN_CYCLES)  # the copies queue behind ~0.4 s of spin

    adapter._deferred_before_copy = before_copy
    adapter.reload(defer_optimizer=True)
    adapter.wait_deferred()  # the slots are free now; the copies may not have run
    assert adapter.arena.pinned
    adapter.arena.release()
    assert adapter.arena.nbytes == 0
    torch.cuda.synchronize()
    got = snapshot(model, optimizer)
    assert sorted(got) == sorted(expected)
    assert all(bits_equal(got[k], expected[k]) for k in expected)
