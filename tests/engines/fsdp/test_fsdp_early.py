"""An adapter's steady rounds copy early (the last round's plan, before listing its tensors) and stay exact;
a reload refused after its early copies restores nothing and loses nothing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from refitkit.engines import DeviceState
from refitkit.engines.fsdp import FSDPAdapter
from refitkit.errors import InvalidInput
from tests.engines.fsdp import ranks
from refitkit.offload.device import local_tensor
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
