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
from tests.engines.fsdp.test_fsdp_failures import _snapshot, _trained

pytestmark = pytest.mark.timeout(180)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[key], b[key]) for key in a)


def test_steady_rounds_copy_before_listing_and_train_bit_identical_to_no_offload():
    model, optimizer = _trained()
    twin, twin_optimizer = _trained()
    adapter = FSDPAdapter(model, optimizer)
    seen: list[tuple[str, bool]] = []
    real_listing = adapter._model_tensors_to_move

    def copied(param: torch.Tensor) -> bool:
        slot = adapter.arena.slot_of(param.untyped_storage())
        nbytes = param.untyped_storage().nbytes()
        return slot is not None and torch.equal(adapter.arena.host_bytes(slot, nbytes), param.detach().view(-1).view(torch.uint8))

    def listing():  # when the model is listed: are its bytes already in the arena (offload) or back (reload)?
        if adapter.part_states.model is DeviceState.ON_DEVICE:
            seen.append(("offload", all(copied(p) for p in model.parameters())))
        else:
            seen.append(("reload", all(p.untyped_storage().nbytes() > 0 for p in model.parameters())))
        return real_listing()

    adapter._model_tensors_to_move = listing  # type: ignore[method-assign]
    twin_optimizer.zero_grad(set_to_none=True)  # as the offload drops the model's grads
    for step in range(1, 4):
        adapter.offload()
        adapter.reload()
        ranks.train_step(model, optimizer, 0, step)
        ranks.train_step(twin, twin_optimizer, 0, step)
        assert _equal(_snapshot(model, optimizer), _snapshot(twin, twin_optimizer)), f"step {step}"
    # the first offload plans; every later move (the first reload included) copies before it lists
    assert seen == [("offload", False), ("reload", True)] + [("offload", True), ("reload", True)] * 2


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
