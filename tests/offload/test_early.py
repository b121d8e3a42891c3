"""Early copies (``offload.early.RoundPlan``): a steady round issues the last round's copies before it is
planned, and a move that then fails or moves something else leaves everything as without them."""

from __future__ import annotations

import time

import pytest
import torch

from refitkit.errors import InvalidInput
from refitkit.offload import HostArena, offload_tensors, reload_tensors
from refitkit.offload import early as early_module
from refitkit.offload.early import RoundPlan
from tests.offload.test_moves import random_tensor, storage_bytes

pytestmark = pytest.mark.timeout(60)


def _tensors(count: int = 6) -> dict[str, torch.Tensor]:
    return {f"t{i}": random_tensor((64 * (i + 1),), torch.float32, seed=i) for i in range(count)}


def _round(tensors: dict[str, torch.Tensor], arena: HostArena, plan: RoundPlan) -> None:
    offload_tensors(tensors, arena, plan=plan)
    plan.issue_reload(arena)
    reload_tensors(tensors, arena, plan=plan)


def test_a_steady_round_copies_early_and_stays_bit_exact():
    tensors, arena, plan = _tensors(), HostArena(), RoundPlan()
    _round(tensors, arena, plan)  # the first round plans; it remembers
    for name, tensor in tensors.items():  # the next step changes every value
        tensor.copy_(random_tensor(tuple(tensor.shape), tensor.dtype, seed=100 + int(name[1:])))
    expected = {name: storage_bytes(t) for name, t in tensors.items()}

    plan.issue_offload(arena)
    slots = {name: arena.slot_of(t.untyped_storage()) for name, t in tensors.items()}
    early = {
        name: bytes(arena.host_bytes(slot, slot.capacity_bytes)[: t.nbytes].tolist())
        for name, (t, slot) in ((n, (tensors[n], s)) for n, s in slots.items())
    }
    assert early == expected, "every storage's bytes were copied before the round was planned"
    offload_tensors(tensors, arena, plan=plan)
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors.values())

    plan.issue_reload(arena)
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in tensors.values()), "regrown before the plan"
    assert {name: storage_bytes(t) for name, t in tensors.items()} == expected
    reload_tensors(tensors, arena, plan=plan)
    assert {name: storage_bytes(t) for name, t in tensors.items()} == expected
    assert not any(slot.holds_data for slot in slots.values())


def test_early_copies_stop_at_the_cap_and_the_plan_issues_the_rest(monkeypatch):
    monkeypatch.setattr(early_module, "EARLY_COPIES_MAX", 2)
    tensors, arena, plan = _tensors(), HostArena(), RoundPlan()
    _round(tensors, arena, plan)
    expected = {name: storage_bytes(t) for name, t in tensors.items()}
    offload_tensors(tensors, arena, plan=plan)
    plan.issue_reload(arena)
    regrown = [name for name, t in tensors.items() if t.untyped_storage().nbytes()]
    assert regrown == ["t5", "t4"] or sorted(regrown) == ["t4", "t5"], "the two largest, nothing more"
    reload_tensors(tensors, arena, plan=plan)
    assert {name: storage_bytes(t) for name, t in tensors.items()} == expected


def test_a_reload_of_fewer_tensors_frees_the_others_it_regrew_early():
    tensors, arena, plan = _tensors(), HostArena(), RoundPlan()
    _round(tensors, arena, plan)
    expected = {name: storage_bytes(t) for name, t in tensors.items()}
    offload_tensors(tensors, arena, plan=plan)
    plan.issue_reload(arena)  # regrows all six
    asked = {name: tensors[name] for name in ("t0", "t3")}
    reload_tensors(asked, arena, plan=plan)

    for name, tensor in tensors.items():
        slot = arena.slot_of(tensor.untyped_storage())
        if name in asked:
            assert storage_bytes(tensor) == expected[name] and not slot.holds_data
        else:
            assert tensor.untyped_storage().nbytes() == 0, f"{name} was not asked for: freed again"
            assert slot.holds_data, f"{name}'s bytes stay in the arena"
    reload_tensors(tensors, arena)
    assert {name: storage_bytes(t) for name, t in tensors.items()} == expected


def test_a_reload_refused_after_early_copies_frees_what_they_regrew_and_loses_nothing():
    tensors, arena, plan = _tensors(), HostArena(), RoundPlan()
    _round(tensors, arena, plan)
    expected = {name: storage_bytes(t) for name, t in tensors.items()}
    view = tensors["t2"].view(-1, 2)  # offloaded with this shape; re-viewed below, so the reload refuses it
    offload_named = {**tensors, "v": view}
    offload_tensors(offload_named, arena, plan=plan)
    held = arena.held_bytes
    plan.issue_reload(arena)
    regrown = sum(1 for t in tensors.values() if t.untyped_storage().nbytes())
    assert regrown == len(tensors)
    view.as_strided_((view.shape[0] // 2, 2), (2, 1))  # re-viewed while offloaded

    with pytest.raises(InvalidInput, match=r"'v' was resized or re-viewed between offload and reload"):
        reload_tensors(offload_named, arena, plan=plan)
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors.values()), "what the early copies regrew is freed"
    assert arena.held_bytes == held, "the offloaded bytes stay in the arena"
    reload_tensors(tensors, arena)
    assert {name: storage_bytes(t) for name, t in tensors.items()} == expected


def test_a_storage_resized_while_offloaded_is_not_regrown_early_and_keeps_its_new_bytes():
    tensors, arena, plan = _tensors(), HostArena(), RoundPlan()
    _round(tensors, arena, plan)
    offload_tensors(tensors, arena, plan=plan)
    resized = tensors["t1"].untyped_storage()
    resized.resize_(8)
    torch.empty(0, dtype=torch.uint8).set_(resized, 0, (8,), (1,)).copy_(torch.arange(8, dtype=torch.uint8))
    plan.issue_reload(arena)

    with pytest.raises(InvalidInput, match=r"'t1': its storage was resized to 8 bytes after offload"):
        reload_tensors(tensors, arena, plan=plan)
    assert bytes(torch.empty(0, dtype=torch.uint8).set_(resized, 0, (8,), (1,)).tolist()) == bytes(range(8))
    assert all(t.untyped_storage().nbytes() == 0 for name, t in tensors.items() if name != "t1")


def test_a_replaced_storage_is_skipped_early_and_its_new_bytes_move():
    tensors, arena, plan = _tensors(), HostArena(), RoundPlan()
    _round(tensors, arena, plan)
    old = tensors["t3"].untyped_storage()
    tensors["t3"].data = random_tensor(tuple(tensors["t3"].shape), torch.float32, seed=77)  # a new storage
    expected = {name: storage_bytes(t) for name, t in tensors.items()}
    plan.issue_offload(arena)
    assert tensors["t3"].untyped_storage()._cdata not in plan.take().keys() | set(), "only the old storage was planned"
    plan.issue_offload(arena)
    offload_tensors(tensors, arena, plan=plan)
    assert old.nbytes() != 0, "the replaced storage is not the tensor's any more: left alone"
    plan.issue_reload(arena)
    reload_tensors(tensors, arena, plan=plan)
    assert {name: storage_bytes(t) for name, t in tensors.items()} == expected


def test_an_offload_refused_after_early_copies_frees_nothing():
    tensors, arena, plan = _tensors(), HostArena(), RoundPlan()
    _round(tensors, arena, plan)
    expected = {name: storage_bytes(t) for name, t in tensors.items()}
    records = dict(arena.views)
    fixed = torch.from_file(__file__, shared=False, size=16, dtype=torch.uint8)  # a non-resizable storage
    plan.issue_offload(arena)

    with pytest.raises(InvalidInput, match=r"'fixed' lives in a non-resizable storage"):
        offload_tensors({**tensors, "fixed": fixed}, arena, plan=plan)
    assert {name: storage_bytes(t) for name, t in tensors.items()} == expected, "nothing was freed"
    assert not any(arena.slot_of(t.untyped_storage()).holds_data for t in tensors.values())
    assert arena.views == records
    offload_tensors(tensors, arena, plan=plan)  # the plan was forgotten: a planned round, still exact
    reload_tensors(tensors, arena)
    assert {name: storage_bytes(t) for name, t in tensors.items()} == expected


def test_a_reload_whose_wait_fails_keeps_the_slots_and_records_and_retries_exactly(monkeypatch):
    from refitkit.errors import RefitError
    from refitkit.offload import moves as moves_module

    tensors, arena = _tensors(), HostArena()
    named = {**tensors, "v": tensors["t2"].view(-1, 2)}
    expected = {name: storage_bytes(t) for name, t in tensors.items()}
    offload_tensors(named, arena)
    records, held = dict(arena.views), arena.held_bytes

    def failing(device: torch.device) -> None:  # the error a failed copy surfaces at the phase's one wait
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(moves_module, "synchronize", failing)
    with pytest.raises(RefitError, match=r"while waiting for the copies on cpu \(RuntimeError: CUDA error"):
        reload_tensors(named, arena)
    assert arena.views == records and arena.held_bytes == held, "the bookkeeping done while copying is undone"
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors.values())
    monkeypatch.undo()
    reload_tensors(named, arena)
    assert {name: storage_bytes(t) for name, t in tensors.items()} == expected


def test_early_offload_copies_left_untaken_are_not_freed_as_regrown_by_a_later_reload_issue():
    tensors, arena, plan = _tensors(), HostArena(), RoundPlan()
    _round(tensors, arena, plan)
    expected = {name: storage_bytes(t) for name, t in tensors.items()}
    plan.issue_offload(arena)  # early copies of resident storages; the caller then never offloads
    plan.issue_reload(arena)  # nothing is offloaded: nothing to regrow
    plan.cancel()
    assert {name: storage_bytes(t) for name, t in tensors.items()} == expected, "the resident storages keep their bytes"


def test_a_moves_time_counts_from_its_early_copies():
    tensors = {f"t{i}": random_tensor((4 << 20,), torch.float32, seed=i) for i in range(4)}  # 64 MiB
    arena, plan = HostArena(), RoundPlan()
    _round(tensors, arena, plan)
    offload_tensors(tensors, arena, plan=plan)
    began = time.perf_counter()
    plan.issue_reload(arena)  # (on the CPU the early copies are done here)
    early_s = time.perf_counter() - began
    stats = reload_tensors(tensors, arena, plan=plan)
    assert stats.seconds >= early_s, "the bytes copied early are counted: so is their time"
    began = time.perf_counter()
    plan.issue_offload(arena)
    early_s = time.perf_counter() - began
    stats = offload_tensors(tensors, arena, plan=plan)
    assert stats.seconds >= early_s, "likewise for an offload"
