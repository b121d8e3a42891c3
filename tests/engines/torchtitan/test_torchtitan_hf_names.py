"""TorchTitanAdapter.named_weights() under Hugging Face names, through torchtitan's own StateDictAdapter.to_hf.

The streamed set must load into a `transformers` model built from the equivalent config with
nothing missing or unexpected, equal its state dict bit for bit, and that model's logits must
match torchtitan's forward on the same tokens.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan", reason="needs the torchtitan env: make test-torchtitan")
pytest.importorskip("transformers", reason="needs transformers in the torchtitan env (envs/torchtitan.txt)")

from tests.engines.torchtitan import hf_ranks  # noqa: E402
from tests.helpers.world import run_world  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("flavour", ["llama3", "qwen3"])
@pytest.mark.parametrize("tp", [1, 2], ids=["fsdp2", "tp2"])
def test_streamed_hf_weights_equal_a_transformers_model_and_its_logits(flavour, tp):
    results = run_world(hf_ranks.hf_names_match_transformers, 2, flavour, tp, timeout_s=240)
    for rank, result in enumerate(results):
        assert result["placements"], "the model was not sharded"
        assert result["unexpected"] == [], f"rank {rank}: names transformers does not know: {result['unexpected']}"
        # a tied head is one tensor: transformers lists lm_head.weight, the stream sends it once as embed_tokens
        allowed_missing = ["lm_head.weight"] if result["tied"] else []
        assert result["missing"] == allowed_missing, f"rank {rank}: not streamed: {result['missing']}"
        assert sorted(set(result["streamed"]) | set(allowed_missing)) == result["hf_names"]
        assert all(result["equal"].values()), [n for n, ok in result["equal"].items() if not ok]
        assert result["max_logit_diff"] <= 1e-4 * max(1.0, result["logit_scale"]), result["max_logit_diff"]
        assert result["cyclic"][0] == 0, f"rank {rank}: {result['cyclic']}"
