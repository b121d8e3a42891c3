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
@pytest.mark.parametrize("world_size, tp", [(2, 1), (2, 2), (4, 2)], ids=["fsdp2", "tp2", "fsdp2xtp2"])
def test_streamed_hf_weights_equal_a_transformers_model_and_its_logits(flavour, world_size, tp):
    results = run_world(hf_ranks.hf_names_match_transformers, world_size, flavour, tp, timeout_s=240)
    for rank, result in enumerate(results):
        assert result["placements"], "the model was not sharded"
        if world_size == 4:  # 2-D: FSDP on top of TP's Shard(0) is a _StridedShard
            assert any("_StridedShard" in p or "_S(" in p for p in result["placements"]), result["placements"]
        assert result["unexpected"] == [], f"rank {rank}: names transformers does not know: {result['unexpected']}"
        # a tied head is one tensor: transformers lists lm_head.weight, the stream sends it once as embed_tokens
        allowed_missing = ["lm_head.weight"] if result["tied"] else []
        assert result["missing"] == allowed_missing, f"rank {rank}: not streamed: {result['missing']}"
        assert sorted(set(result["streamed"]) | set(allowed_missing)) == result["hf_names"]
        assert all(result["equal"].values()), [n for n, ok in result["equal"].items() if not ok]
        assert result["max_logit_diff"] <= 1e-4 * max(1.0, result["logit_scale"]), result["max_logit_diff"]
        assert result["cyclic"][0] == 0, f"rank {rank}: {result['cyclic']}"


@pytest.mark.parametrize(
    "world_size, pp", [(2, 2), (4, 2)], ids=["pp2-one-rank-a-stage", "pp2xfsdp2-two-ranks-a-stage"]
)
def test_every_pipeline_stage_reaches_every_rank_once_under_its_hf_layer_names(world_size, pp):
    results = run_world(hf_ranks.pipeline_stages_reach_every_rank, world_size, "llama3", pp, timeout_s=280)
    first = results[0]
    assert all(result["stages"] == 2 for result in results), "Interleaved1F1B puts two stages on each rank"
    # the whole model, once, with transformers' names and shapes: all layers of all stages
    assert sorted(first["digests"]) == sorted(first["hf_shapes"])
    assert {n: shape for n, (shape, _, _) in first["digests"].items()} == first["hf_shapes"]
    for rank, result in enumerate(results):
        assert result["digests"] == first["digests"], f"rank {rank} streamed other bytes than rank 0"
        assert result["order"] == first["order"]
        # each rank's own stages: exactly torchtitan's state dict through to_hf
        assert result["own"] and sorted(result["own_equal"]) == result["own"]
        assert all(result["own_equal"].values()), f"rank {rank}: {result['own_equal']}"
        assert result["cyclic"][0] == 0, f"rank {rank}: {result['cyclic']}"
    # the pipeline ranks own disjoint stages that together are the model, so no stage renumbered its
    # layers: stages (embeddings, layer 0, layer 1, head) go round-robin, rank 0 gets embeddings + layer 1
    owners = [set(results[r]["own"]) for r in range(0, world_size, world_size // pp)]
    assert not owners[0] & owners[1] and owners[0] | owners[1] == set(first["hf_shapes"])
    layers_of_rank0 = {n.split(".")[2] for n in owners[0] if n.startswith("model.layers.")}
    assert layers_of_rank0 == {"1"}, sorted(owners[0])


def test_a_weight_to_hf_does_not_know_is_named_and_a_wrong_adapter_is_refused(caplog):
    import logging

    import torch
    from torch import nn
    from torchtitan.models.llama3.config_registry import llama3_debugmodel_ce_loss

    from refitkit.engines.torchtitan import TorchTitanAdapter
    from refitkit.errors import InvalidInput

    spec = llama3_debugmodel_ce_loss().model_spec
    sd_adapter = spec.state_dict_adapter(spec.model, None)
    model = nn.Module()
    model.tok_embeddings = nn.Embedding(4, 3)
    model.extra_head = nn.Linear(3, 2)  # no HF name in Llama3StateDictAdapter's map
    adapter = TorchTitanAdapter([model], state_dict_adapter=sd_adapter)
    weights = adapter.named_weights()
    assert not getattr(
        weights, "refitkit_holds_tensors", False
    )  # to_hf's tensors are new ones: no sender may hold them
    name, tensor = next(weights)
    assert name == "model.embed_tokens.weight" and torch.equal(tensor, model.tok_embeddings.weight)
    with pytest.raises(InvalidInput, match=r"to_hf could not convert \['extra_head.weight'\].*state_dict_adapter=None"):
        next(weights)
    with pytest.raises(InvalidInput, match="state_dict_adapter is a dict"):
        TorchTitanAdapter([model], state_dict_adapter={"tok_embeddings.weight": "model.embed_tokens.weight"})
    with caplog.at_level(logging.INFO, logger="refitkit.engines.torchtitan.adapter"):
        native = TorchTitanAdapter([model])
    assert [r.getMessage() for r in caplog.records].count(
        "TorchTitanAdapter: no state_dict_adapter given; named_weights() yields torchtitan's FQNs"
    ) == 1
    assert [n for n, _ in native.named_weights()][:2] == ["tok_embeddings.weight", "extra_head.weight"]
    assert native.named_weights().refitkit_holds_tensors is True  # torchtitan's own tensors, as they are
