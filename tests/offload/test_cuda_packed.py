"""Packed copies of small storages on a GPU: pinned arena bytes equal per-storage copies; exact round trips."""

from __future__ import annotations

import pytest
import torch

from refitkit.offload import HostArena, flush_device, offload_tensors, reload_tensors
from tests.helpers.bits import bits_equal
from tests.offload.test_packed import mixed_tensors, slot_bytes

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(120)]


def test_packed_copies_on_the_gpu_match_per_storage_copies_and_round_trip_exactly():
    plain = [t.cuda() for t in mixed_tensors()]
    packed = [t.cuda() for t in mixed_tensors()]
    packed[-2] = packed[3][1:]  # keep the view a view of the GPU copy
    plain[-2] = plain[3][1:]
    originals = [t.clone() for t in packed]
    plain_arena, packed_arena = HostArena(), HostArena()
    assert packed_arena.pinned
    offload_tensors(plain, plain_arena)
    offload_tensors(packed, packed_arena, pack_below_bytes=64 << 10)
    flush_device()
    assert slot_bytes(packed_arena, packed) == slot_bytes(plain_arena, plain)
    assert all(t.untyped_storage().nbytes() == 0 for t in packed)
    for _ in range(2):  # first and steady rounds
        reload_tensors(packed, packed_arena, pack_below_bytes=64 << 10)
        torch.cuda.synchronize()
        assert all(bits_equal(t, o) for t, o in zip(packed, originals))
        offload_tensors(packed, packed_arena, pack_below_bytes=64 << 10)
    reload_tensors(packed, packed_arena, pack_below_bytes=64 << 10)
    assert all(bits_equal(t, o) for t, o in zip(packed, originals))
