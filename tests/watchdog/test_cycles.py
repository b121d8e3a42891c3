"""CycleAudit finds the cyclic garbage a block makes, and leaves the GC exactly as it found it."""

from __future__ import annotations

import gc

import pytest
import torch

from refitkit.errors import LeakDetected
from refitkit.offload import (
    HostArena,
    offload_grads,
    offload_optimizer,
    offload_tensors,
    reload_grads,
    reload_optimizer,
    reload_tensors,
)
from refitkit.watchdog import CycleAudit, assert_no_cycles

pytestmark = pytest.mark.timeout(60)


class Holder:
    pass


def plant_cycle(nbytes: int = 1 << 20) -> None:
    holder = Holder()
    holder.me = holder
    holder.payload = torch.ones(nbytes // 4)


@pytest.fixture
def restore_gc():
    """Tests below change the GC's settings on purpose; put the process back afterwards."""
    state = (gc.isenabled(), gc.get_threshold(), gc.get_debug())
    yield
    gc.set_debug(state[2])
    gc.set_threshold(*state[1])
    (gc.enable if state[0] else gc.disable)()


def test_finds_the_planted_cycle_its_tensor_bytes_and_how_it_is_held():
    survivor = torch.ones(1024)  # reachable: must not be reported
    # some interpreters start with objects already frozen (seen on the GPU image): then the audit
    # cannot freeze cleanly and falls back to collecting first
    expected_method = "freeze" if gc.get_freeze_count() == 0 else "collect-before"
    with CycleAudit() as audit:
        plant_cycle()
        kept = torch.zeros(2048)
    report = audit.report
    assert report.method == expected_method
    assert report.by_type[f"{__name__}.Holder"] == 1
    assert report.by_type["torch.Tensor"] == 1
    assert report.tensor_bytes == {"cpu": 1 << 20}
    assert [t.storage_bytes for t in report.tensors] == [1 << 20]
    assert report.tensors[0].shape == ((1 << 20) // 4,) and report.tensors[0].dtype == "float32"
    assert report.largest_chain[0].startswith("Tensor(float32[262144] on cpu, 1048576 B)")
    assert report.largest_chain[1] == f"{__name__}.Holder.payload"
    assert "cycle closed" in report.largest_chain[-1]
    assert "1048576 B" in report.summary()
    assert survivor.sum() == 1024 and kept.numel() == 2048


def test_counts_shared_storage_once_and_frees_what_it_found():
    import weakref

    with CycleAudit() as audit:
        holder = Holder()
        base = torch.ones(1 << 16)
        holder.views = [base[:100], base[100:], base]
        holder.me = holder
        probe = weakref.ref(base)
        del holder, base
    # two views of one storage (torch keeps the base's Python object alive through the views,
    # so the collector does not list it): the storage's bytes count once
    assert audit.report.by_type["torch.Tensor"] >= 2
    assert audit.report.tensor_bytes == {"cpu": 4 << 16}
    assert probe() is None  # the audit freed the garbage it captured


def test_clean_block_reports_zero():
    with CycleAudit() as audit:
        tensors = [torch.randn(64) for _ in range(10)]
        total = sum(t.sum() for t in tensors)
    assert audit.report.clean and audit.report.cyclic_objects == 0 and audit.report.tensor_bytes == {}
    assert torch.isfinite(total)


def test_garbage_made_before_the_block_is_not_reported():
    plant_cycle()  # pre-existing garbage
    with CycleAudit() as audit:
        pass
    assert audit.report.cyclic_objects == 0


def test_restores_gc_state_flags_thresholds_and_garbage(restore_gc):
    sentinel = object()
    frozen_before = gc.get_freeze_count()
    gc.garbage.append(sentinel)
    try:
        gc.disable()
        gc.set_threshold(1234, 5, 6)
        gc.set_debug(gc.DEBUG_UNCOLLECTABLE)
        with CycleAudit() as audit:
            assert not gc.isenabled()
            plant_cycle()
        assert not audit.report.clean
        assert (gc.isenabled(), gc.get_threshold(), gc.get_debug()) == (False, (1234, 5, 6), gc.DEBUG_UNCOLLECTABLE)
        assert gc.garbage == [sentinel] and gc.get_freeze_count() == frozen_before
        gc.enable()
        with CycleAudit():
            assert not gc.isenabled()  # no automatic collection inside the audited block
        assert gc.isenabled()
    finally:
        gc.garbage.remove(sentinel)


def test_restores_state_when_the_block_raises(restore_gc):
    gc.set_threshold(777, 8, 9)
    frozen_before = gc.get_freeze_count()
    audit = CycleAudit()
    with pytest.raises(KeyError):
        with audit:
            plant_cycle()
            raise KeyError("boom")
    assert gc.isenabled() and gc.get_threshold() == (777, 8, 9) and gc.get_freeze_count() == frozen_before
    assert audit.report.tensor_bytes == {"cpu": 1 << 20}


def test_works_as_a_decorator():
    audit = CycleAudit()

    @audit
    def leaky_step(n):
        for _ in range(n):
            plant_cycle(4096)
        return n

    assert leaky_step(3) == 3
    assert audit.report.by_type[f"{__name__}.Holder"] == 3 and audit.report.tensor_bytes == {"cpu": 3 * 4096}


def test_falls_back_when_objects_are_already_frozen():
    gc.freeze()
    try:
        with CycleAudit() as audit:
            plant_cycle()
        assert audit.report.method == "collect-before"
        assert audit.report.tensor_bytes == {"cpu": 1 << 20}
        assert gc.get_freeze_count() > 0  # the caller's freeze is untouched
    finally:
        gc.unfreeze()


def test_assert_no_cycles_raises_leak_detected_with_the_summary():
    with pytest.raises(LeakDetected, match=r"my step created cyclic garbage.*Holder.*cpu: 1048576 B"):
        with assert_no_cycles("my step"):
            plant_cycle()
    with assert_no_cycles("clean step") as audit:
        torch.ones(8).add_(1)
    assert audit.report.clean


def _round(model, optimizer, arena):
    named = list(model.named_parameters())
    offload_grads(named, arena, keep=True)
    offload_tensors(named, arena)
    offload_optimizer(optimizer, arena)
    reload_tensors(named, arena)
    reload_optimizer(optimizer, arena)
    reload_grads(named, arena)


@pytest.mark.parametrize("round_index", ["first", "steady"])
def test_offload_core_round_creates_zero_cyclic_garbage(round_index):
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    # "first" is an arena's first round (it allocates and pins), not the process's first use of the
    # CUDA host-registration path, whose lazy setup belongs to whichever test ran first: do that here.
    warm, warm_arena = [torch.zeros(8)], HostArena()
    offload_tensors(warm, warm_arena)
    reload_tensors(warm, warm_arena)
    warm_arena.release()
    arena = HostArena()
    if round_index == "steady":
        _round(model, optimizer, arena)
    with assert_no_cycles(f"{round_index} offload/reload round") as audit:
        _round(model, optimizer, arena)
    assert audit.report.cyclic_objects == 0
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name])  # the round really moved and restored the bytes
    assert arena.held_bytes == 0 and arena.nbytes > 0
