"""Which shared segments a reload reserves (the plan only: the allocations themselves are GPU tests)."""

from __future__ import annotations

import pytest
import torch

from refitkit.offload.device import SegmentedRegrow, segment_plan

pytestmark = pytest.mark.timeout(30)

MIB, GIB = 1 << 20, 1 << 30


def test_consecutive_large_storages_share_a_segment_up_to_its_size_and_a_lone_one_gets_none():
    sizes = [3 * GIB, 1200 * MIB, 700 * MIB, 100 * MIB, 512 * 1024, 300 * MIB, 2 * GIB - 512, 64 * MIB]
    plan = segment_plan(sizes)
    # 3 GiB is alone (over the segment size); 1200+700+100 MiB share one (the small one in between is skipped
    # and allocates from the small pool); 300 MiB + 2 GiB would not fit, so 300 MiB starts a run alone and
    # 2 GiB - 512 B with 64 MiB would not fit either: two lone storages, no reservation
    assert plan == {1: (1200 + 700 + 100) * MIB}


def test_sizes_are_rounded_as_the_allocator_rounds_them():
    sizes = [MIB + 1, MIB + 1, MIB + 1]
    plan = segment_plan(sizes)
    assert plan == {0: 3 * (MIB + 512)}


def test_on_the_cpu_nothing_is_reserved():
    regrow = SegmentedRegrow(torch.device("cpu"), [GIB, GIB])
    regrow.before(0)
    assert regrow._reserve_at == {} and regrow.segments == 0


def test_with_expandable_segments_nothing_is_reserved(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert SegmentedRegrow(torch.device("cuda", 0), [GIB, GIB])._reserve_at == {}
