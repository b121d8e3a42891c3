"""Reading or replacing the optimizer state while a deferred reload is ARRIVING waits for it first.

A checkpoint taken right after ``reload(defer_optimizer=True)`` (``optimizer.state_dict()``, torch's
``get_optimizer_state_dict``) must see the state's bytes, not storages still being regrown; a state
loaded then must not be overwritten by copies that land later. The worker is held back with a
``threading.Event`` through ``adapter._deferred_before_copy``; a pre-hook of the same kind,
registered before the reload (so torch runs it before the adapter's), releases it: the call
provably started while nothing had arrived, and the adapter's hook must wait for the copies.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from refitkit.engines import DeviceState
from refitkit.engines.fsdp import FSDPAdapter
from refitkit.errors import DeferredTimeout, RefitError
from refitkit.offload.deferred import ArrivalState
from tests.helpers.bits import bits_equal
from tests.offload.test_deferred import make, offloaded_after_two_steps, optimizer_device_bytes, train_step

pytestmark = pytest.mark.timeout(120)

GATE_S = 30.0  # the longest a held-back copy waits for its gate (a bound, never reached when the test passes)

Saved = dict[str, torch.Tensor | object]


def saved(state_dict: dict) -> Saved:
    """What a checkpoint keeps of a state dict: its tensors' bytes at the time of the call, flattened."""
    out: Saved = {"param_groups": copy.deepcopy(state_dict["param_groups"])}
    for key, state in state_dict["state"].items():
        out.update({f"state.{key}.{name}": value.clone() for name, value in state.items()})
    return out


def same_saved(a: Saved, b: Saved) -> bool:
    if sorted(a) != sorted(b) or a["param_groups"] != b["param_groups"]:
        return False
    return all(bits_equal(a[k], b[k]) for k in a if k != "param_groups")


def fresh(state_dict: dict) -> dict:
    """A deep copy: a loaded state dict's tensors become the optimizer's (training writes into them)."""
    return copy.deepcopy(state_dict)


def hook_counts(optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    return (
        len(optimizer._optimizer_step_pre_hooks),
        len(optimizer._optimizer_state_dict_pre_hooks),
        len(optimizer._optimizer_load_state_dict_pre_hooks),
    )


def trained(steps: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, optimizer = make(seed)
    for step in range(steps):
        train_step(model, optimizer, step)
    return model, optimizer


def release_from(register: Callable, adapter: FSDPAdapter, optimizer: torch.optim.Optimizer) -> dict:
    """Hold the deferred copies back until a pre-hook registered with ``register`` runs (before the adapter's)."""
    gate = threading.Event()
    adapter._deferred_before_copy = lambda name: gate.wait(GATE_S)
    seen: dict = {}

    def at_call_start(opt: torch.optim.Optimizer, *args: object) -> None:
        if "state" not in seen:
            seen["optimizer_bytes"] = optimizer_device_bytes(optimizer)
            seen["state"] = adapter._gate.deferred.state
            gate.set()  # only now may the copies run: the adapter's hook must wait for them

    seen["handle"] = register(at_call_start)
    return seen


def started_early(seen: dict) -> bool:
    seen["handle"].remove()
    return seen["optimizer_bytes"] == 0 and seen["state"] is ArrivalState.COPYING


def test_state_dict_while_arriving_waits_and_is_bit_identical_to_a_run_without_offload():
    _, reference = trained(2)
    expected = saved(reference.state_dict())
    model, optimizer, adapter, _ = offloaded_after_two_steps()
    seen = release_from(optimizer.register_state_dict_pre_hook, adapter, optimizer)
    adapter.reload(defer_optimizer=True)
    checkpoint = saved(optimizer.state_dict())  # cloned at once, as torch.save would write it
    assert started_early(seen)
    assert adapter.part_states.optimizer is DeviceState.ON_DEVICE  # state_dict() waited for the arrival
    assert hook_counts(optimizer) == (0, 0, 0)  # all of the adapter's hooks went with the arrival
    assert adapter.arena.held_bytes == 0  # the arrival freed the arena's slots, as a step's wait would
    assert same_saved(checkpoint, expected)


def test_load_state_dict_while_arriving_waits_then_its_values_win():
    _, source = trained(3, seed=1)  # another run's state: every value differs from this one's
    loaded = source.state_dict()
    reference_model, reference = trained(2)
    reference.load_state_dict(fresh(loaded))
    reference_losses = [train_step(reference_model, reference, s) for s in range(2, 4)]
    model, optimizer, adapter, _ = offloaded_after_two_steps()
    seen = release_from(optimizer.register_load_state_dict_pre_hook, adapter, optimizer)
    adapter.reload(defer_optimizer=True)
    optimizer.load_state_dict(fresh(loaded))
    assert started_early(seen)
    assert adapter.part_states.optimizer is DeviceState.ON_DEVICE  # the load waited: no copy lands after it
    assert hook_counts(optimizer) == (0, 0, 0)
    assert same_saved(saved(optimizer.state_dict()), saved(loaded))
    losses = [train_step(model, optimizer, s) for s in range(2, 4)]
    assert losses == reference_losses
    assert same_saved(saved(optimizer.state_dict()), saved(reference.state_dict()))


def test_an_in_place_load_through_torch_dcp_state_dict_while_arriving_keeps_the_loaded_values():
    """DCP's load: get the state dict, write the checkpoint into its tensors in place, set it back."""
    source_model, source = trained(3, seed=1)
    loaded = get_optimizer_state_dict(source_model, source)
    reference_model, reference = trained(2)
    model, optimizer, adapter, _ = offloaded_after_two_steps()
    seen = release_from(optimizer.register_state_dict_pre_hook, adapter, optimizer)
    adapter.reload(defer_optimizer=True)
    target = get_optimizer_state_dict(model, optimizer)
    assert started_early(seen)
    assert adapter.part_states.optimizer is DeviceState.ON_DEVICE  # reading waited: no copy lands after the writes
    for fqn, state in target["state"].items():
        for name, value in state.items():
            value.copy_(loaded["state"][fqn][name])  # what dcp.load does with the tensors it was given
    set_optimizer_state_dict(model, optimizer, target)
    reference.load_state_dict(fresh(source.state_dict()))
    losses = [train_step(model, optimizer, s) for s in range(2, 4)]
    assert losses == [train_step(reference_model, reference, s) for s in range(2, 4)]
    assert same_saved(saved(optimizer.state_dict()), saved(reference.state_dict()))


def test_a_failed_deferred_reload_makes_state_dict_and_load_raise_naming_the_tensor_and_loses_nothing():
    _, reference = trained(2)
    expected = saved(reference.state_dict())
    model, optimizer, adapter, _ = offloaded_after_two_steps()
    victim = "optimizer.param_groups[0].params[1].exp_avg_sq"

    def fail_on(name: str) -> None:
        if name == victim:
            raise RuntimeError("injected: out of device memory")

    adapter._deferred_before_copy = fail_on
    adapter.reload(defer_optimizer=True)
    for call in (optimizer.state_dict, lambda: optimizer.load_state_dict(fresh(reference.state_dict()))) * 2:
        with pytest.raises(RefitError, match=r"deferred reload of FSDPAdapter's optimizer state failed") as info:
            call()  # every call raises while the state is not there; none reads or replaces freed state
        assert repr(victim) in str(info.value) and "injected: out of device memory" in str(info.value)
        assert "call reload() again" in str(info.value)
    assert adapter.part_states.optimizer is DeviceState.OFFLOADED
    assert optimizer_device_bytes(optimizer) == 0  # the load did not replace the state: the arena's bytes still fit
    adapter._deferred_before_copy = None
    adapter.reload()  # the retry rule of a plain reload
    assert hook_counts(optimizer) == (0, 0, 0)
    assert same_saved(saved(optimizer.state_dict()), expected)


def test_a_stalled_deferred_reload_makes_state_dict_raise_deferred_timeout_within_the_bound():
    _, reference = trained(2)
    expected = saved(reference.state_dict())
    model, optimizer, adapter, _ = offloaded_after_two_steps()
    gate = threading.Event()
    adapter._deferred_before_copy = lambda name: gate.wait(GATE_S)
    adapter.reload(defer_optimizer=True, deferred_timeout_s=0.2)
    start = time.perf_counter()
    with pytest.raises(DeferredTimeout, match=r"did not arrive within deferred_timeout_s=0\.2 s") as info:
        optimizer.state_dict()
    assert time.perf_counter() - start < GATE_S  # the bound ended the wait, not the held copy's release
    assert "raise deferred_timeout_s" in str(info.value) and "nothing was lost" in str(info.value)
    assert adapter.part_states.optimizer is DeviceState.ARRIVING
    assert hook_counts(optimizer) == (1, 1, 1)  # still waiting: the hooks stay
    gate.set()
    assert same_saved(saved(optimizer.state_dict()), expected)  # a later call waits again and gets every byte
    assert hook_counts(optimizer) == (0, 0, 0)


def test_hooks_registered_after_the_reload_neither_break_the_call_nor_keep_the_adapters():
    """torch loops over an optimizer's hooks in an OrderedDict: the running hook may not vanish mid-loop."""
    reference_model, reference = trained(2)
    reference_losses = [train_step(reference_model, reference, 2)]
    expected = saved(reference.state_dict())
    reference_losses.append(train_step(reference_model, reference, 3))
    model, optimizer, adapter, _ = offloaded_after_two_steps()
    calls = []
    adapter.reload(defer_optimizer=True)
    user_hooks = [optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("step"))]
    losses = [train_step(model, optimizer, 2)]
    assert hook_counts(optimizer) == (1, 0, 0)  # only the user's: the adapter's running hook went after the step
    assert len(optimizer._optimizer_step_post_hooks) == 0  # and so did the post-hook that removed it
    adapter.offload()
    adapter.reload(defer_optimizer=True)
    user_hooks.append(optimizer.register_state_dict_pre_hook(lambda opt: calls.append("state_dict")))
    assert same_saved(saved(optimizer.state_dict()), expected)
    assert hook_counts(optimizer) == (1, 1, 0) and len(optimizer._optimizer_state_dict_post_hooks) == 0
    losses.append(train_step(model, optimizer, 3))
    assert calls == ["step", "state_dict", "step"]
    assert losses == reference_losses
    for handle in user_hooks:
        handle.remove()


def test_a_call_that_raises_in_a_later_hook_leaves_nothing_behind_after_the_next_call():
    """The adapter's running hook is to go after the call; a later hook raising skips the post-hooks."""
    model, optimizer, adapter, _ = offloaded_after_two_steps()
    adapter.reload(defer_optimizer=True)

    def refuse(opt: torch.optim.Optimizer) -> None:
        raise RuntimeError("injected: the user's hook refuses")

    refusing = optimizer.register_state_dict_pre_hook(refuse)
    with pytest.raises(RuntimeError, match="the user's hook refuses"):
        optimizer.state_dict()
    assert adapter.part_states.optimizer is DeviceState.ON_DEVICE  # the adapter's hook had waited
    assert hook_counts(optimizer) == (0, 2, 0)  # its state_dict hook is still there, a no-op now
    refusing.remove()
    optimizer.state_dict()
    assert hook_counts(optimizer) == (0, 0, 0)
    assert len(optimizer._optimizer_state_dict_post_hooks) == 0
