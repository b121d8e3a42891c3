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


@pytest.mark.parametrize(
    "world_size, ep, tp", [(2, 1, 1), (2, 2, 1), (4, 2, 2)], ids=["fsdp2-moe", "ep2-moe", "tp2xep2-moe"]
)
def test_moe_streams_per_expert_views_equal_to_transformers_checkpoint(world_size, ep, tp, tmp_path):
    results = run_world(hf_ranks.moe_names_match_transformers, world_size, ep, tp, str(tmp_path), timeout_s=280)
    first = results[0]
    experts = [n for n in first["streamed"] if ".mlp.experts." in n]
    assert len(experts) == 2 * 8 * 3, experts  # 2 layers x 8 experts x gate / up / down, global expert numbers
    # what transformers saves back from what it loaded is the stream, name for name and bit for bit
    assert first["streamed"] == first["resaved"]
    assert all(first["equal"].values()), [n for n, ok in first["equal"].items() if not ok]
    for rank, result in enumerate(results):
        if ep > 1:  # experts sharded over the expert-parallel mesh dim (under FSDP's _StridedShard when both)
            assert any("Shard(dim=0))" in p for p in result["placements"]), result["placements"]
        assert result["missing"] == [] and result["unexpected"] == [] and result["mismatched"] == [], result
        # every rank streams the same set once (so one sender sends every weight, dense ones included, once)
        assert result["streamed"] == first["streamed"]
        assert result["distinct_experts"], f"rank {rank}: two experts streamed the same tensor"
        # w1_EFD / w3_EFD / w2_EDF are gathered once each and every expert is a contiguous view of it
        assert result["not_views"] == [] and result["contiguous"]
        for layer in range(2):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                names = [f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" for e in range(8)]
                assert len({result["storages"][n] for n in names}) == 1, (rank, layer, proj)
        gate_up = {result["storages"][f"model.layers.0.mlp.experts.0.{p}.weight"] for p in ("gate_proj", "up_proj")}
        assert len(gate_up) == 2  # gate from w1, up from w3
        # torchtitan runs its experts in bf16, transformers in fp32; a swap of two experts moves far more
        tolerance = 1e-2 * max(1.0, result["logit_scale"])
        assert result["max_logit_diff"] <= tolerance, result["max_logit_diff"]
        assert result["swapped_logit_diff"] > 5 * tolerance, result["swapped_logit_diff"]
        assert result["cyclic"][0] == 0, f"rank {rank}: {result['cyclic']}"


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


def test_a_trained_expert_bias_that_to_hf_drops_is_warned_once_by_name(caplog):
    import logging

    import torch
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

    from refitkit.engines.torchtitan import TorchTitanAdapter

    config = hf_ranks.tiny_moe_config()
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("cpu"):
        model = config.build()
    model.init_weights(buffer_device=None)
    adapter = TorchTitanAdapter([model], state_dict_adapter=Qwen3StateDictAdapter(config, None))
    logger = "refitkit.engines.torchtitan.adapter"
    with caplog.at_level(logging.WARNING, logger=logger):
        names = [name for name, _ in adapter.named_weights()]
    assert caplog.records == []  # a zero bias (as initialised) routes as transformers' Qwen3-MoE does
    assert not any("bias" in name for name in names) and len(names) == 69
    with torch.no_grad():  # what torchtitan's load-balancing hook does to it over training
        model.layers["1"].moe.expert_bias_E[3] = 0.25
    with caplog.at_level(logging.WARNING, logger=logger):
        for _ in range(2):
            assert [name for name, _ in adapter.named_weights()] == names
    assert [r.getMessage() for r in caplog.records] == [
        "TorchTitanAdapter.named_weights(): Qwen3StateDictAdapter.to_hf has no Hugging Face name for "
        "layers.1.moe.expert_bias_E, which is not all zeros; the engine's model goes without it and routes tokens "
        "otherwise than the trainer (build the MoE with load_balance_coeff=None to train without this bias)"
    ]
