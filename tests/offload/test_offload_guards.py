"""Mistakes with offloaded tensors are refused before any damage, with an error that says what happened."""

from __future__ import annotations

import logging

import pytest
import torch

from refitkit.errors import InvalidInput
from refitkit.offload import HostArena, offload_tensors, reload_tensors


def test_a_consumed_generator_is_refused_while_the_arena_holds_its_bytes():
    model = torch.nn.Linear(32, 16)
    before = [param.detach().clone() for param in model.parameters()]
    arena = HostArena()
    params = model.parameters()  # a generator: iterated once by the offload
    offload_tensors(params, arena)
    assert all(param.untyped_storage().nbytes() == 0 for param in model.parameters())

    with pytest.raises(
        InvalidInput,
        match=r"reload_tensors got no tensors from a generator while the arena still holds \d+ offloaded bytes",
    ):
        reload_tensors(params, arena)
    assert arena.held_bytes == sum(param.nbytes for param in before)  # nothing lost, nothing moved

    reload_tensors(list(model.parameters()), arena)
    assert all(torch.equal(param, saved) for param, saved in zip(model.parameters(), before))
    assert reload_tensors(iter([]), arena).bytes == 0  # an empty iterator with nothing held is fine


def test_a_cycle_without_a_sender_on_one_rank_says_it_syncs_nothing(caplog):
    from refitkit.engines.fsdp import FSDPAdapter
    from refitkit.refit import RefitCycle

    model = torch.nn.Linear(8, 4)
    with caplog.at_level(logging.WARNING, logger="refitkit.refit"):
        RefitCycle(FSDPAdapter(model), None).close()
    assert "without a sender: refit() offloads FSDPAdapter but sends its weights nowhere" in caplog.text
