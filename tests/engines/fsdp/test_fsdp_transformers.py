"""FSDPAdapter streams a transformers 5 model under the names and layouts its ``save_pretrained()`` writes: fused
Mixture-of-Experts weights one tensor per expert and projection, bit for bit, as views (no copies); dense models as
they are. Needs transformers (the core venv has none: `make test-automodel` runs this file in the automodel venv)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers 5: make test-automodel runs this file")

from refitkit.engines.fsdp import FSDPAdapter  # noqa: E402
from refitkit.errors import InvalidInput  # noqa: E402
from tests.engines.fsdp import transformers_ranks  # noqa: E402
from tests.engines.fsdp.transformers_ranks import MOE_FAMILIES, compare, saved_checkpoint, tiny_model  # noqa: E402
from tests.helpers.bits import bits_equal  # noqa: E402
from tests.helpers.world import run_world  # noqa: E402

pytestmark = pytest.mark.timeout(240)

EXPERTS, LAYERS = 8, 2


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_fused_moe_streams_what_save_pretrained_writes_as_views_of_its_own_tensors(family, tmp_path):
    model = tiny_model(family)
    saved = saved_checkpoint(model, str(tmp_path))
    weights = FSDPAdapter(model).named_weights()
    assert weights.refitkit_holds_tensors is True  # views of the model's own tensors: a sender may read them in place
    streamed = list(weights)

    found = compare(streamed, saved)
    assert sorted(found["names"]) == found["saved_names"] and found["duplicates"] == []
    assert found["unequal"] == []
    experts = [name for name in found["names"] if ".experts." in name]
    assert len(experts) == LAYERS * EXPERTS * 3  # gate, up and down of every expert, none fused
    # no copies: every tensor lies in the memory of one of the model's parameters
    own = {param.untyped_storage().data_ptr() for param in model.parameters()}
    assert all(tensor.untyped_storage().data_ptr() in own for _, tensor in streamed)
    assert all(tensor.is_contiguous() for _, tensor in streamed)


def test_gate_comes_before_up_in_the_fused_tensor_as_qwen3_moes_forward_reads_it(tmp_path):
    """Qwen3MoeExperts.forward: ``gate, up = linear(x, gate_up_proj[e]).chunk(2, dim=-1)``."""
    model = tiny_model("qwen3_moe")
    streamed = dict(FSDPAdapter(model).named_weights())
    experts = model.model.layers[1].mlp.experts
    width = experts.gate_up_proj.shape[1] // 2
    for expert in range(EXPERTS):
        prefix = f"model.layers.1.mlp.experts.{expert}."
        assert bits_equal(streamed[prefix + "gate_proj.weight"], experts.gate_up_proj[expert, :width])
        assert bits_equal(streamed[prefix + "up_proj.weight"], experts.gate_up_proj[expert, width:])
        assert bits_equal(streamed[prefix + "down_proj.weight"], experts.down_proj[expert])
    assert streamed["model.layers.1.mlp.experts.0.gate_proj.weight"].shape == (32, 64)
    assert streamed["model.layers.1.mlp.experts.0.down_proj.weight"].shape == (64, 32)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_an_fsdp2_sharded_moe_streams_what_save_pretrained_writes_one_gather_per_fused_tensor(family, tmp_path):
    results = run_world(
        transformers_ranks.sharded_stream_matches_save_pretrained, 2, str(tmp_path), family, timeout_s=240
    )
    for rank, result in enumerate(results):
        assert result["sharded"] == ["DTensor"], f"rank {rank}: the model was not sharded"
        assert result["trained"]
        assert sorted(result["names"]) == result["saved_names"] and result["duplicates"] == []
        assert result["unequal"] == [], f"rank {rank}: {result['unequal']}"
        assert result["names"] == results[0]["names"]
        assert result["types"] == ["Tensor"]
        assert result["layer0_expert_tensors"] == EXPERTS * 3
        assert result["layer0_storages"] == 2
        assert result["says_held"] is False and result["says_fresh"] is True  # views of gathered tensors: fresh


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_dense_transformers_model_streams_its_own_tensors_under_its_own_names(family, tmp_path):
    model = tiny_model(family)
    saved = saved_checkpoint(model, str(tmp_path))
    streamed = list(FSDPAdapter(model).named_weights())
    own = model.state_dict(keep_vars=True)
    # the tied head is the embedding, streamed once under the embedding's name, as save_pretrained writes it
    expected = [name for name in own if not (family == "qwen3" and name == "lm_head.weight")]
    assert [name for name, _ in streamed] == expected
    assert all(tensor.data_ptr() == own[name].data_ptr() for name, tensor in streamed)
    found = compare(streamed, saved)
    assert sorted(found["names"]) == found["saved_names"] and found["unequal"] == []


def test_checkpoint_names_false_streams_the_fused_in_memory_names():
    model = tiny_model("qwen3_moe")
    streamed = dict(FSDPAdapter(model, checkpoint_names=False).named_weights())
    assert list(streamed) == list(model.state_dict())
    assert streamed["model.layers.0.mlp.experts.gate_up_proj"].shape == (EXPERTS, 64, 64)
    with pytest.raises(InvalidInput, match="FSDPAdapter: checkpoint_names= must be a bool, got 'yes'"):
        FSDPAdapter(model, checkpoint_names="yes")


def test_a_torch_compiled_moe_streams_the_checkpoints_names(tmp_path):
    model = tiny_model("qwen3_moe")
    saved = saved_checkpoint(model, str(tmp_path))
    streamed = list(FSDPAdapter(torch.compile(model)).named_weights())
    found = compare(streamed, saved)
    assert sorted(found["names"]) == found["saved_names"] and found["unequal"] == []
