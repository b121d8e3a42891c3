"""Packed copies of small storages (``pack_below_bytes``): same arena bytes, exact round trips, no foreign slot touched."""

from __future__ import annotations

import pytest
import torch

from refitkit.errors import InvalidInput
from refitkit.offload import HostArena, offload_tensors, reload_tensors
from refitkit.offload.moves import _group_by_storage, named_tensors, packed_runs
from tests.helpers.bits import bits_equal

pytestmark = pytest.mark.timeout(120)


def mixed_tensors(seed: int = 0) -> list[torch.Tensor]:
    """Many small storages of odd sizes and dtypes (norms, biases, scalars), views among them, two large ones."""
    g = torch.Generator().manual_seed(seed)
    tensors = []
    for i in range(40):
        n = 1 + (i * 37) % 300
        dtype = (torch.float32, torch.bfloat16, torch.int64, torch.float16)[i % 4]
        tensors.append((torch.randn(n, generator=g) * 100).to(dtype))
    tensors.append(torch.randn(64, 1024, generator=g))  # 256 KiB: copied on its own
    tensors.append(tensors[3][1:])  # a view sharing a small storage
    tensors.append(torch.randn(4096, generator=g).to(torch.bfloat16))
    return tensors


def slot_bytes(arena: HostArena, tensors: list[torch.Tensor]) -> list[bytes]:
    out = []
    for group in _group_by_storage(named_tensors(tensors)):
        slot = arena.slot_of(group.storage)
        out.append(bytes(arena.host_bytes(slot, slot.nbytes).numpy()))
    return out


def test_packed_offload_fills_the_arena_exactly_like_per_storage_copies_and_round_trips():
    plain, packed = mixed_tensors(), mixed_tensors()
    originals = [t.clone() for t in plain]
    plain_arena, packed_arena = HostArena(), HostArena()
    offload_tensors(plain, plain_arena)
    moved = offload_tensors(packed, packed_arena, pack_below_bytes=4096)
    assert moved.bytes == plain_arena.held_bytes == packed_arena.held_bytes
    assert slot_bytes(packed_arena, packed) == slot_bytes(plain_arena, plain)
    assert all(t.untyped_storage().nbytes() == 0 for t in packed)
    # the plan really packs: the small storages' slots were reserved together, back to back
    groups = _group_by_storage(named_tensors(packed))
    moves = [(g, packed_arena.slot_of(g.storage), packed_arena.slot_of(g.storage).nbytes) for g in groups]
    runs, singles = packed_runs(moves, below_bytes=4096)
    assert len(runs) >= 1 and sum(len(r) for r in runs) >= 30 and len(singles) < 10
    reload_tensors(packed, packed_arena, pack_below_bytes=4096)
    assert all(bits_equal(t, o) for t, o in zip(packed, originals))
    assert packed_arena.held_bytes == 0
    # a steady second round reuses the same slots
    offload_tensors(packed, packed_arena, pack_below_bytes=4096)
    reload_tensors(packed, packed_arena, pack_below_bytes=4096)
    assert all(bits_equal(t, o) for t, o in zip(packed, originals)) and packed_arena.chunks == 1


def test_a_run_never_spans_the_slot_of_a_storage_outside_the_call():
    a, b, c, d = (torch.full((n,), float(n)) for n in (5, 7, 9, 11))
    arena = HostArena()
    arena.reserve(t.untyped_storage() for t in (a, b, c, d))  # slots a|b|c|d back to back
    offload_tensors([b], arena)  # b's bytes sit between a's and c's slots
    b_bytes = bytes(arena.host_bytes(arena.slot_of(b.untyped_storage()), 28).numpy())
    offload_tensors([a, c, d], arena, pack_below_bytes=1024)  # c|d pack; a stands alone
    assert bytes(arena.host_bytes(arena.slot_of(b.untyped_storage()), 28).numpy()) == b_bytes
    reload_tensors([a, b, c, d], arena, pack_below_bytes=1024)
    assert [t.tolist() for t in (a, b, c, d)] == [[float(n)] * n for n in (5, 7, 9, 11)]


def test_pack_below_bytes_must_be_a_non_negative_int():
    t = torch.ones(3)
    for bad in (-1, 1.5, True, "4096"):
        with pytest.raises(InvalidInput, match=r"pack_below_bytes="):
            offload_tensors([t], HostArena(), pack_below_bytes=bad)
    assert t.untyped_storage().nbytes() == 12  # nothing moved


def test_an_adapter_with_pack_below_bytes_trains_bit_identically():
    from refitkit.engines.fsdp import FSDPAdapter
    from tests.offload.test_deferred import make, same, serial_run, snapshot, train_step

    reference_losses, reference = serial_run()
    model, optimizer = make()
    losses = [train_step(model, optimizer, s) for s in range(2)]
    adapter = FSDPAdapter(model, optimizer)
    adapter.pack_below_bytes = 1 << 20
    adapter.offload()
    assert adapter.state_bytes().device_bytes == 0
    adapter.reload()
    losses += [train_step(model, optimizer, s) for s in range(2, 4)]
    assert losses == reference_losses and same(snapshot(model, optimizer), reference)
