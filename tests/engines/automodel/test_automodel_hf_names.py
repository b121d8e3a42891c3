"""AutomodelAdapter streams Automodel's own models under HF names: a MoE through its real StateDictAdapter, a dense one as-is."""

from __future__ import annotations

import pytest

pytest.importorskip("nemo_automodel", reason="needs the automodel env: make test-automodel")

from tests.engines.automodel import hf_ranks  # noqa: E402
from tests.helpers.world import run_world  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(
    "world_size, kind, ep",
    [(1, "moe", 1), (1, "dense", 1), (2, "moe", 1), (2, "dense", 1), (2, "moe", 2)],
    ids=["1-moe", "1-dense", "fsdp2-moe", "fsdp2-dense", "ep2-moe"],
)
def test_stream_loads_into_transformers_bit_exact_with_matching_logits(world_size, kind, ep, tmp_path):
    results = run_world(hf_ranks.hf_names_match_transformers, world_size, str(tmp_path), kind, ep, timeout_s=240)
    for rank, result in enumerate(results):
        if world_size > 1:
            assert result["placements"], "the model was not sharded"
        if ep > 1:  # each expert-parallel rank holds its own experts; every rank streams all of them, once
            assert result["expert_placements"] == ["['ep'](Shard(dim=0),)"], result["expert_placements"]
        # the MoE goes through its StateDictAdapter; grouped experts come out one HF tensor per expert and
        # projection (2 layers x 4 experts x 3); the dense model has no adapter and its names are HF's
        assert result["has_converter"] == (kind == "moe")
        assert result["experts"] == (2 * 4 * 3 if kind == "moe" else 0)
        assert result["missing"] == [] and result["unexpected"] == [] and result["mismatched"] == [], result
        assert result["streamed"] == results[0]["streamed"]
        if rank == 0:
            # what transformers saves back from what it loaded is the stream, name for name and bit for bit
            assert result["streamed"] == result["resaved"]
            assert all(result["equal"].values()), [n for n, ok in result["equal"].items() if not ok]
        assert result["max_logit_diff"] <= 1e-4 * max(1.0, result["logit_scale"]), result["max_logit_diff"]
        assert result["cyclic"][0] == 0, f"rank {rank}: {result['cyclic']}"
