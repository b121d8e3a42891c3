"""gather_full: every DTensor layout gathered bit-exact without full_tensor() and without cyclic garbage."""

from __future__ import annotations

import pytest

from tests.engines.fsdp import layout_ranks
from tests.helpers.world import run_world

pytestmark = pytest.mark.timeout(240)


def test_every_layout_gathers_bit_exact_with_no_cyclic_garbage():
    results = run_world(layout_ranks.gather_every_layout, 4, timeout_s=200)
    for rank, result in enumerate(results):
        partial = result.pop("partial_error")
        assert "'layers.0.w'" in partial and "mesh dim 0" in partial and "neither Shard nor Replicate" in partial, (
            partial
        )
        cyclic, by_type = result.pop("cyclic")
        assert cyclic == 0, f"rank {rank}: gathers left cyclic garbage {by_type}"
        # the audit sees what full_tensor() leaves, so 0 above is a real measurement
        assert result.pop("cyclic_full_tensor") > 0
        for layout, (kind, equal, _local_shape) in result.items():
            assert kind == "Tensor", layout
            assert equal, f"rank {rank}: {layout} differs from the source tensor"
    # uneven layouts really were uneven: rank 3 holds an empty shard of the (3, 5) tensor under Shard(0)
    assert results[3]["Shard(0)(3, 5)"][2] == (0, 5)


def test_fsdp_times_tp_named_weights_equal_the_unsharded_model():
    results = run_world(layout_ranks.fsdp_tp_named_weights, 4, timeout_s=200)
    for rank, result in enumerate(results):
        assert "_StridedShard" in result["placements"]["0.up.weight"] or "_S(" in result["placements"]["0.up.weight"], (
            result["placements"]
        )
        assert sorted(result["names"]) == sorted(result["reference_names"])
        assert all(result["equal"].values()), f"rank {rank}: {result['equal']}"
        assert result["cyclic"][0] == 0, f"rank {rank}: {result['cyclic']}"
