"""MegatronAdapter.named_weights() at TP/PP/VPP/EP layouts: Hugging Face names and layouts, checked
against a ``transformers`` model of the same config (names, shapes, bit-exact values, logits)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from tests.engines.megatron import parallel_gpt, tiny_gpt
from tests.engines.megatron.parallel_gpt import Layout
from tests.helpers.world import run_world

pytestmark = pytest.mark.timeout(900)

transformers = pytest.importorskip("transformers")


def stream_world(rank: int, world_size: int, layout: Layout) -> dict:
    from megatron.core import parallel_state

    from refitkit.engines.megatron import MegatronAdapter, is_stream_source
    from refitkit.watchdog import CycleAudit

    chunks = parallel_gpt.build(layout)
    adapter = MegatronAdapter(chunks, hf_family=layout.family)
    with CycleAudit() as audit:
        streamed = [(name, tensor.to("cpu", copy=True)) for name, tensor in adapter.named_weights()]
    return {
        "streamed": streamed,
        "cyclic_objects": audit.report.cyclic_objects,
        "source": is_stream_source(),
        "logits": parallel_gpt.forward_logits(chunks, layout),
        "coords": (
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_expert_model_parallel_rank(),
        ),
    }


def _merge(results: list[dict]) -> dict[str, torch.Tensor]:
    """Every rank's stream in one dict; a name that several ranks send must be bit-identical on all."""
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        names = [name for name, _ in result["streamed"]]
        assert len(names) == len(set(names)), f"a rank streamed a name twice: {names}"
        for name, tensor in result["streamed"]:
            if name in merged:
                assert torch.equal(merged[name], tensor), f"{name} differs between ranks"
            else:
                merged[name] = tensor
    return merged


def _load_hf(layout: Layout, weights: dict[str, torch.Tensor]):
    """A transformers model loaded the way vLLM-style loaders get them: a checkpoint of exactly these tensors."""
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="refitkit-hf-") as directory:
        parallel_gpt.hf_config(layout).save_pretrained(directory)
        save_file({name: t.contiguous() for name, t in weights.items()}, os.path.join(directory, "model.safetensors"))
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            directory, dtype=torch.bfloat16, output_loading_info=True
        )
    return model.eval(), info


def _expected_hf_state(model, layout: Layout) -> dict[str, torch.Tensor]:
    """The HF model's state dict in checkpoint names: experts per expert (transformers 5 fuses them in memory)."""
    state = {name: t for name, t in model.state_dict().items() if not (layout.tied and name == "lm_head.weight")}
    for name in [n for n in state if n.endswith("mlp.experts.gate_up_proj")]:
        prefix = name[: -len("gate_up_proj")]
        gate_up, down = state.pop(name), state.pop(prefix + "down_proj")
        for expert in range(gate_up.shape[0]):
            gate, up = gate_up[expert].chunk(2, dim=0)
            state[f"{prefix}{expert}.gate_proj.weight"] = gate
            state[f"{prefix}{expert}.up_proj.weight"] = up
            state[f"{prefix}{expert}.down_proj.weight"] = down[expert]
    return state


LAYOUTS = {
    "tp2": (2, Layout(tp=2, family="qwen3")),
    "pp2-llama-tied": (2, Layout(pp=2, family="llama", tied=True)),
    "pp2-vpp2": (2, Layout(pp=2, vpp=2, num_layers=8, family="qwen3")),
    "ep2-moe": (2, Layout(ep=2, moe=True, family="qwen3_moe", num_layers=2)),
    "tp2-qwen2-bias": (2, Layout(tp=2, family="qwen2")),
    "tp2-ep2-moe": (4, Layout(tp=2, ep=2, moe=True, family="qwen3_moe", num_layers=2)),
    "tp2-qwen2-moe-shared": (2, Layout(tp=2, moe=True, shared_ffn=48, family="qwen2_moe", num_layers=2)),
    "pp2-ep2-moe": (4, Layout(pp=2, ep=2, moe=True, family="qwen3_moe", num_layers=4)),
    "tp2-pp2": (4, Layout(tp=2, pp=2, family="qwen3")),
    "tp2-pp2-vpp2": (4, Layout(tp=2, pp=2, vpp=2, num_layers=8, family="qwen3")),
}


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_named_weights_equal_transformers_model(label: str) -> None:
    world_size, layout = LAYOUTS[label]
    os.environ["HF_HUB_OFFLINE"] = "1"
    results = run_world(stream_world, world_size, layout, timeout_s=600.0)
    streamed = _merge(results)

    model, info = _load_hf(layout, streamed)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    expected = _expected_hf_state(model, layout)
    assert sorted(streamed) == sorted(expected)
    for name, tensor in expected.items():
        assert streamed[name].shape == tensor.shape, name
        assert streamed[name].dtype == torch.bfloat16, name
        assert torch.equal(streamed[name], tensor), f"{name} changed on its way into transformers"

    # no rank gathers experts it does not own: each expert comes from exactly one expert-parallel rank
    if layout.ep > 1:
        owners: dict[str, set[int]] = {}
        for result in results:
            for name, _ in result["streamed"]:
                if ".experts." in name:
                    owners.setdefault(name, set()).add(result["coords"][2])
        assert all(len(ranks) == 1 for ranks in owners.values()), owners
        assert {r for ranks in owners.values() for r in ranks} == set(range(layout.ep))

    assert [r["cyclic_objects"] for r in results] == [0] * world_size

    # one sender per (pipeline stage, expert-parallel rank) delivers every weight
    sources = [r for r in results if r["source"]]
    assert sorted((r["coords"][1], r["coords"][2]) for r in sources) == [
        (stage, expert_rank) for stage in range(layout.pp) for expert_rank in range(layout.ep)
    ]
    assert _merge(sources).keys() == streamed.keys()

    tokens, _ = tiny_gpt.batch(0, 0)
    with torch.no_grad():
        hf_logits = model(tokens).logits.float()
    megatron_logits = [r["logits"] for r in results if r["logits"] is not None]
    assert megatron_logits
    for logits in megatron_logits:
        assert logits.shape == hf_logits.shape
        # the same function up to bf16 rounding; one misplaced gate/up row block moves the mean by ~0.9 std
        difference = (logits - hf_logits).abs()
        scale = hf_logits.std().item()
        assert difference.mean().item() < 0.03 * scale, (difference.mean().item(), scale)
        assert difference.max().item() < 0.2 * scale, (difference.max().item(), scale)


def refusal_world(rank: int, world_size: int) -> dict:
    from refitkit.engines.megatron import MegatronAdapter
    from refitkit.errors import InvalidInput

    trainer = tiny_gpt.build(with_optimizer=False)  # LayerNorm with biases: no Llama/Qwen name for them
    seen = {}
    try:
        MegatronAdapter(trainer.chunks, hf_family="gpt2")
        seen["family"] = "no error"
    except InvalidInput as error:
        seen["family"] = str(error)
    adapter = MegatronAdapter(trainer.chunks, hf_family="llama")
    try:
        adapter.named_weights()  # refused at the call, before a generator exists or a gather runs
        seen["names"] = "no error"
    except InvalidInput as error:
        seen["names"] = str(error)
    return seen


def test_a_model_the_table_cannot_name_is_refused_before_streaming() -> None:
    (seen,) = run_world(refusal_world, 1, timeout_s=300.0)
    assert "hf_family='gpt2' has no Megatron -> Hugging Face table; known: ['llama', 'qwen2'" in seen["family"]
    assert "Megatron parameter(s) have no Hugging Face name in the 'llama' table" in seen["names"]
    assert "'decoder.layers.0.input_layernorm.bias'" in seen["names"]
    assert "hf_family=None" in seen["names"]
