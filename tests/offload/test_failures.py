"""Failures leave the offload state recoverable: real allocation failures in a spawned process.

The host allocator really runs out: the child lowers its own address-space limit
(``RLIMIT_AS``) just above what it uses, so the next big allocation fails with ENOMEM, then
raises the limit again (the "memory was freed" of a real run) and retries the same call.
"""

from __future__ import annotations

import pytest
import torch

from tests.offload.child import address_space_headroom, run_in_child

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20


def _child_setup() -> None:
    torch.set_num_threads(1)  # no thread pool (and its stacks) appears while the limit is low


def failed_reserve_then_retry() -> dict:
    from refitkit.offload import HostArena, offload_tensors, reload_tensors

    _child_setup()
    a = torch.full((64 * MIB,), 0x11, dtype=torch.uint8)
    b = torch.full((64 * MIB,), 0x22, dtype=torch.uint8)
    arena = HostArena(pin_memory=False)
    dead = torch.ones(1024)
    offload_tensors({"dead": dead}, arena)
    reload_tensors({"dead": dead}, arena)
    del dead  # its slot is free for a storage that fits, like `small` below
    small = torch.full((1024,), 7.0)
    with address_space_headroom(16 * MIB):
        try:
            offload_tensors({"small": small, "a": a}, arena)
            error = None
        except Exception as caught:  # noqa: BLE001 - reported to the parent as data
            error = (type(caught).__name__, str(caught))
    after_failure = {
        "a_device_bytes": a.untyped_storage().nbytes(),
        "arena_nbytes": arena.nbytes,
        "chunks": arena.chunks,
        "a_has_slot": arena.slot_of(a.untyped_storage()) is not None,
        "small_has_slot": arena.slot_of(small.untyped_storage()) is not None,
        "small_device_bytes": small.untyped_storage().nbytes(),
    }
    # the retry, and another storage offloaded in between: each must get its own host bytes
    offload_tensors({"b": b}, arena)
    offload_tensors({"a": a}, arena)
    held = arena.held_bytes
    reload_tensors({"a": a, "b": b}, arena)
    return {
        "error": error,
        "after_failure": after_failure,
        "held": held,
        "a_intact": bool((a == 0x11).all()),
        "b_intact": bool((b == 0x22).all()),
        "arena_nbytes": arena.nbytes,
    }


def test_a_failed_reservation_leaves_the_arena_as_it_was_and_a_retry_keeps_bytes_apart():
    result = run_in_child(failed_reserve_then_retry)
    assert result["b_intact"], "b came back with another storage's bytes"
    assert result["a_intact"]
    assert result["held"] == 128 * MIB
    assert result["after_failure"] == {
        "a_device_bytes": 64 * MIB,
        "arena_nbytes": 4096,
        "chunks": 1,
        "a_has_slot": False,
        "small_has_slot": False,
        "small_device_bytes": 4096,
    }
    kind, message = result["error"]
    assert kind == "RefitError", result["error"]
    assert f"allocating {64 * MIB} host bytes for 1 storages failed" in message
    assert "nothing was reserved" in message
    assert result["arena_nbytes"] == 4096 + 128 * MIB


def failed_reload_then_retry() -> dict:
    from refitkit.offload import HostArena, offload_tensors, reload_tensors

    _child_setup()
    tensors = {f"w{i}": torch.randint(0, 256, (32 * MIB,), dtype=torch.uint8) for i in range(4)}
    expected = {name: t.clone() for name, t in tensors.items()}
    arena = HostArena(pin_memory=False)
    offload_tensors(tensors, arena)
    # two storages fit, the third does not
    with address_space_headroom(80 * MIB):
        try:
            reload_tensors(tensors, arena)
            error = None
        except Exception as caught:  # noqa: BLE001 - reported to the parent as data
            error = (type(caught).__name__, str(caught))
    after_failure = {
        "device_bytes": [t.untyped_storage().nbytes() for t in tensors.values()],
        "held": arena.held_bytes,
    }
    moved = reload_tensors(tensors, arena).bytes
    return {
        "error": error,
        "after_failure": after_failure,
        "moved": moved,
        "intact": [torch.equal(tensors[name], expected[name]) for name in tensors],
        "held": arena.held_bytes,
    }


def test_a_reload_that_fails_part_way_can_be_retried_bit_exact():
    result = run_in_child(failed_reload_then_retry)
    kind, message = result["error"]
    assert kind == "RefitError", result["error"]
    assert "while restoring 'w2' on cpu" in message and "call reload again" in message
    # the two storages regrown before the failure were freed again; the arena kept every byte
    assert result["after_failure"] == {"device_bytes": [0, 0, 0, 0], "held": 4 * 32 * MIB}
    assert result["moved"] == 4 * 32 * MIB
    assert result["intact"] == [True] * 4
    assert result["held"] == 0


def adapter_reload_retry() -> dict:
    from torch import nn

    from refitkit.engines.fsdp import FSDPAdapter
    from refitkit.offload import HostArena

    _child_setup()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])  # 16 MiB of fp32 weight each
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 2048)).sum().backward()
    optimizer.step()
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    expected_state = [s["exp_avg"].clone() for s in optimizer.state.values()]
    adapter = FSDPAdapter(model, optimizer, arena=HostArena(pin_memory=False))
    adapter.offload()
    with address_space_headroom(40 * MIB):
        try:
            adapter.reload()
            error = None
        except Exception as caught:  # noqa: BLE001 - reported to the parent as data
            error = (type(caught).__name__, str(caught))
    state_after_failure = adapter.state.name
    device_bytes_after_failure = adapter.state_bytes().device_bytes
    adapter.reload()
    return {
        "error": error,
        "state_after_failure": state_after_failure,
        "device_bytes_after_failure": device_bytes_after_failure,
        "state": adapter.state.name,
        "intact": all(torch.equal(p, expected[name]) for name, p in model.named_parameters()),
        "state_intact": all(torch.equal(s["exp_avg"], e) for s, e in zip(optimizer.state.values(), expected_state)),
    }


def test_an_adapter_reload_that_runs_out_of_memory_stays_offloaded_and_retries():
    result = run_in_child(adapter_reload_retry)
    assert result["error"] is not None and result["error"][0] == "RefitError", result["error"]
    assert "call reload again" in result["error"][1]
    assert result["state_after_failure"] == "OFFLOADED"
    assert result["device_bytes_after_failure"] == 0
    assert result["state"] == "ON_DEVICE"
    assert result["intact"] and result["state_intact"]
