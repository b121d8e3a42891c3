"""An adapter's steady rounds copy early (the last round's plan, before listing its tensors) and stay exact;
a reload refused after its early copies restores nothing and loses nothing; the bookkeeping that needs no
finished copy (freeing unkept grads, releasing a reload's records) runs while the copies do, and a reload
that fails after releasing its records still refuses a param replaced afterwards."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from refitkit.engines import DeviceState
from refitkit.engines.fsdp import FSDPAdapter
from refitkit.errors import InvalidInput, RefitError
from refitkit.offload.device import local_tensor
from tests.engines.fsdp import ranks
from tests.engines.fsdp.test_fsdp_failures import _snapshot, _trained
from tests.helpers.world import run_world

pytestmark = pytest.mark.timeout(180)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[key], b[key]) for key in a)


def _moves_seen_at_listing(rank: int, world_size: int, fsdp: bool) -> dict:
    """Rounds of offload, reload and a step against a twin that never offloads; what each move's listing found."""
    model, optimizer = ranks.build(world_size, fsdp=fsdp, mixed_precision=False)
    twin, twin_optimizer = ranks.build(world_size, fsdp=fsdp, mixed_precision=False)
    for m, o in ((model, optimizer), (twin, twin_optimizer)):
        ranks.train_step(m, o, rank, 0)
    adapter = FSDPAdapter(model, optimizer)
    seen: list[tuple[str, bool]] = []
    real_listing = adapter._model_tensors_to_move
    params = [local_tensor(p) for p in model.parameters()]  # (a DTensor's local view is a new object each time)

    def copied(param: torch.Tensor) -> bool:
        storage = param.untyped_storage()
        slot = adapter.arena.slot_of(storage)
        flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        return slot is not None and torch.equal(adapter.arena.host_bytes(slot, storage.nbytes()), flat)

    def listing():  # when the model is listed: are its bytes already in the arena (offload) or back (reload)?
        if adapter.part_states.model is DeviceState.ON_DEVICE:
            seen.append(("offload", all(copied(p) for p in params)))
        else:
            seen.append(("reload", all(p.untyped_storage().nbytes() > 0 for p in params)))
        return real_listing()

    adapter._model_tensors_to_move = listing  # type: ignore[method-assign]
    identical = []
    for step in range(1, 4):
        adapter.offload()
        adapter.reload()
        ranks.train_step(model, optimizer, rank, step)
        ranks.train_step(twin, twin_optimizer, rank, step)
        identical.append(_equal(ranks.local_state(model, optimizer), ranks.local_state(twin, twin_optimizer)))
    return {"seen": seen, "identical": identical}


@pytest.mark.parametrize("fsdp", [False, True], ids=["plain-module", "fsdp2-ws1"])
def test_steady_rounds_copy_before_listing_and_train_bit_identical_to_no_offload(fsdp):
    (result,) = run_world(_moves_seen_at_listing, 1, fsdp, timeout_s=150)
    assert result["identical"] == [True, True, True]
    # the first offload plans; every later move (the first reload included) copies before it lists
    assert result["seen"] == [("offload", False), ("reload", True)] + [("offload", True), ("reload", True)] * 2


def test_a_replaced_param_refused_after_early_copies_restores_nothing_and_loses_nothing():
    model, optimizer = _trained()
    adapter = FSDPAdapter(model, optimizer)
    adapter.offload()
    adapter.reload()  # a round: the next ones copy early
    expected = _snapshot(model, optimizer)
    adapter.offload()
    held = adapter.arena.held_bytes
    original = model.head.weight
    model.head.weight = nn.Parameter(torch.zeros(original.shape))

    with pytest.raises(InvalidInput, match=r"'model\.head\.weight' was replaced or removed while offloaded"):
        adapter.reload()
    assert adapter.state is DeviceState.OFFLOADED
    assert all(p.untyped_storage().nbytes() == 0 for name, p in model.named_parameters() if name != "head.weight"), (
        "the storages regrown early are freed again"
    )
    assert original.untyped_storage().nbytes() == 0
    assert adapter.arena.held_bytes == held
    model.head.weight = original
    adapter.reload()
    assert _equal(_snapshot(model, optimizer), expected)


@pytest.mark.parametrize("keep_grads", [False, True], ids=["grads-dropped", "grads-kept"])
def test_grads_are_freed_and_records_released_before_the_copies_are_waited_for(monkeypatch, keep_grads):
    from refitkit.offload import moves as moves_module

    model, optimizer = _trained()
    expected = _snapshot(model, optimizer)
    adapter = FSDPAdapter(model, optimizer, keep_grads=keep_grads)
    params = [p for p in model.parameters() if p.requires_grad]
    at_wait: dict[str, object] = {}
    phase: list[str] = []
    real_wait = moves_module.synchronize

    def waits(device: torch.device) -> None:  # a move's wait for its copies (the last one of each phase is kept)
        if phase[-1] == "offload":
            at_wait["grads"] = [p.grad is None for p in params]
        else:
            at_wait["records"] = {part: len(held) for part, held in adapter._offloaded.items()}
        real_wait(device)

    monkeypatch.setattr(moves_module, "synchronize", waits)
    count = len(params)  # (the asserts name no param: an offloaded one has no bytes to print)
    phase.append("offload")
    adapter.offload()
    assert at_wait["grads"] == [not keep_grads] * count, "unkept grads are freed before the wait; kept ones copied"
    assert [p.grad is None for p in params] == [not keep_grads] * count
    assert adapter._offloaded["model"] and adapter._offloaded["optimizer"]
    phase.append("reload")
    adapter.reload()
    assert all(count == 0 for count in at_wait["records"].values()), f"records left at the wait: {at_wait['records']}"
    assert adapter.state is DeviceState.ON_DEVICE and adapter._offloaded == {}
    assert _equal(_snapshot(model, optimizer), expected)
    assert [p.grad is None for p in params] == [not keep_grads] * count


def test_a_reload_that_failed_at_its_wait_still_refuses_a_param_replaced_afterwards(monkeypatch):
    from refitkit.offload import moves as moves_module

    model, optimizer = _trained()
    expected = _snapshot(model, optimizer)
    adapter = FSDPAdapter(model, optimizer, keep_grads=True)
    adapter.offload()
    real_wait = moves_module.synchronize

    def failing(device: torch.device) -> None:  # the device reports an error once the copies are waited for
        raise RuntimeError("injected: the copies failed")

    monkeypatch.setattr(moves_module, "synchronize", failing)
    with pytest.raises(RefitError, match="waiting for the copies"):
        adapter.reload()
    monkeypatch.setattr(moves_module, "synchronize", real_wait)
    assert adapter.state is DeviceState.OFFLOADED
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    original, grad = model.head.weight, model.head.weight.grad
    model.head.weight = nn.Parameter(torch.zeros(original.shape))
    with pytest.raises(InvalidInput, match=r"'model\.head\.weight' was replaced or removed while offloaded"):
        adapter.reload()
    model.head.weight = original
    original.grad = torch.zeros(original.shape)
    with pytest.raises(InvalidInput, match=r"'model\.head\.weight\.grad' was replaced"):
        adapter.reload()
    original.grad = grad
    adapter.reload()
    assert adapter.state is DeviceState.ON_DEVICE
    assert _equal(_snapshot(model, optimizer), expected)


@pytest.mark.parametrize("order", ["grads-alone", "after-the-rest"])
def test_unkept_grads_are_freed_when_an_offload_has_nothing_else_to_copy(order):
    model, optimizer = _trained()
    adapter = FSDPAdapter(model, optimizer)
    count = len([p for p in model.parameters() if p.requires_grad])
    if order == "grads-alone":
        adapter.offload(model=False, optimizer=False, grad=True)  # no storage to copy: the copies never run
    else:
        adapter.offload(grad=False)
        adapter.offload()  # only the grads are left, and they are not copied
    assert adapter.part_states.grad is DeviceState.OFFLOADED
    assert [p.grad is None for p in model.parameters() if p.requires_grad] == [True] * count
    assert adapter.state_bytes().grad.device_bytes == 0
    adapter.reload()
    assert adapter.state is DeviceState.ON_DEVICE


@pytest.mark.parametrize("old_kept", [True, False], ids=["old-param-still-referenced", "old-param-gone"])
def test_a_param_replaced_on_the_device_between_rounds_moves_under_its_name(old_kept):
    # the records of a round are reused by the next one only for a name whose storage is still the same
    model, optimizer = _trained()
    adapter = FSDPAdapter(model)  # (the optimizer would keep the old param: here only the model moves)
    adapter.offload()
    adapter.reload()
    old = model.head.weight
    model.head.weight = nn.Parameter(torch.randn(old.shape))
    kept = [old] if old_kept else []
    del old
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    for _ in range(2):  # (each assert on a plain bool: an offloaded tensor has no bytes to print)
        adapter.offload()
        freed = model.head.weight.untyped_storage().nbytes() == 0
        assert freed
        try:  # (a traceback through the move would print its offloaded arguments)
            adapter.reload()
            refused = None
        except InvalidInput as error:
            refused = str(error)
        assert refused is None, refused
        restored = all(torch.equal(p, expected[name]) for name, p in model.named_parameters())
        assert restored
    untouched = all(t.untyped_storage().nbytes() > 0 for t in kept)
    assert untouched, "the old param was never part of the moves"
