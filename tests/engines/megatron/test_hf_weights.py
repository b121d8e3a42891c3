"""MegatronAdapter.named_weights() at TP/PP/VPP/EP layouts: Hugging Face names and layouts, checked
against a ``transformers`` model of the same config (names, shapes, bit-exact values, logits).

The reference is transformers' own checkpoint: the streamed tensors load into a transformers model
with nothing missing or left over, its ``save_pretrained`` writes back exactly the streamed names and
bytes (transformers 5 fuses experts in memory and splits them per expert again on save), and its
logits match Megatron's. GroupedMLP experts run on the CPU through ``cpu_shim.install_grouped_gemm``.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest
import torch

from tests.engines.megatron import parallel_gpt, tiny_gpt
from tests.engines.megatron.parallel_gpt import EXPERTS, Layout
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


def _saved_checkpoint(model) -> dict[str, torch.Tensor]:
    """What transformers' ``save_pretrained`` writes for the model: its checkpoint names and tensors."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory(prefix="refitkit-hf-saved-") as directory:
        model.save_pretrained(directory)
        files = sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))
        assert files, os.listdir(directory)
        saved: dict[str, torch.Tensor] = {}
        for name in files:
            saved.update(load_file(os.path.join(directory, name)))
    return saved


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
    "ep2-moe-grouped": (2, Layout(ep=2, moe=True, grouped_gemm=True, family="qwen3_moe", num_layers=2)),
    "tp2-moe-grouped": (2, Layout(tp=2, moe=True, grouped_gemm=True, family="qwen3_moe", num_layers=2)),
}


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_named_weights_equal_transformers_model(label: str) -> None:
    world_size, layout = LAYOUTS[label]
    if layout.grouped_gemm and torch.cuda.is_available() and importlib.util.find_spec("grouped_gemm") is None:
        pytest.skip("GroupedMLP needs the grouped_gemm package on the GPU (the CPU shim stands in only without CUDA)")
    os.environ["HF_HUB_OFFLINE"] = "1"
    results = run_world(stream_world, world_size, layout, timeout_s=600.0)
    streamed = _merge(results)

    model, info = _load_hf(layout, streamed)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    expected = _saved_checkpoint(model)
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
    # ... exactly once per sync: dense weights from one expert-parallel rank, not from each
    counts: dict[str, int] = {}
    for result in sources:
        for name, _ in result["streamed"]:
            counts[name] = counts.get(name, 0) + 1
    assert {name: n for name, n in counts.items() if n != 1} == {}
    if layout.moe:
        # experts of a layer differ (a swapped or repeated expert could not hide behind equal values)
        for layer in range(layout.num_layers):
            gates = [streamed[f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight"] for e in range(EXPERTS)]
            assert all(not torch.equal(gates[i], gates[j]) for i in range(EXPERTS) for j in range(i)), layer

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
        # per token: an MoE router's top-k tie that bf16 rounding breaks the other way moves one token's
        # logits (seen: 1 of 32); a misplaced weight or expert moves nearly every token
        per_token = difference.amax(dim=-1).flatten()
        outliers = int((per_token >= 0.2 * scale).sum())
        assert outliers <= (per_token.numel() // 16 if layout.moe else 0), (per_token.tolist(), scale)


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


def megatron_names_world(rank: int, world_size: int, layout: Layout) -> list[tuple[str, tuple[int, ...]]]:
    from refitkit.engines.megatron import MegatronAdapter

    adapter = MegatronAdapter(parallel_gpt.build(layout))  # hf_family=None: Megatron's names
    return [(name, tuple(tensor.shape)) for name, tensor in adapter.named_weights()]


def test_grouped_experts_stream_per_expert_in_megatron_names_dense_weights_once() -> None:
    layout = Layout(ep=2, moe=True, grouped_gemm=True, family="qwen3_moe", num_layers=2)
    if torch.cuda.is_available() and importlib.util.find_spec("grouped_gemm") is None:
        pytest.skip("GroupedMLP needs the grouped_gemm package on the GPU")
    first, second = run_world(megatron_names_world, 2, layout, timeout_s=300.0)
    fc1, fc2 = (2 * layout.moe_ffn, layout.hidden), (layout.hidden, layout.moe_ffn)

    def experts(numbers):
        return [
            (f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.{linear}.weight", shape)
            for layer in range(layout.num_layers)
            for linear, shape in (("linear_fc1", fc1), ("linear_fc2", fc2))  # weight1's experts, then weight2's
            for e in numbers
        ]

    # expert-parallel rank 1: its two experts (global numbers 2, 3), SequentialMLP's layout, nothing dense
    assert second == experts([2, 3])
    assert [item for item in first if ".mlp.experts." in item[0]] == experts([0, 1])
    dense = [name for name, _ in first if ".mlp.experts." not in name]
    assert "embedding.word_embeddings.weight" in dense and "decoder.layers.1.mlp.router.weight" in dense
    # embedding, final norm, output; a layer: 2 norms, qkv, proj, q and k norms, router
    assert len(dense) == len(set(dense)) == 3 + 7 * layout.num_layers


def refused_expert_tp_world(rank: int, world_size: int, layout: Layout) -> str:
    from refitkit.engines.megatron import MegatronAdapter
    from refitkit.errors import InvalidInput

    adapter = MegatronAdapter(parallel_gpt.build(layout), hf_family="qwen3_moe")
    try:
        adapter.named_weights()  # refused at the call on every rank: no rank is left inside a gather
    except InvalidInput as error:
        return str(error)
    return "no error"


def test_expert_tensor_parallel_size_other_than_tp_is_refused_before_any_gather() -> None:
    layout = Layout(tp=2, etp=1, ep=2, moe=True, family="qwen3_moe", num_layers=2)
    messages = run_world(refused_expert_tp_world, 2, layout, timeout_s=300.0)
    for message in messages:
        assert "expert_tensor_parallel_size=1 differs from tensor_model_parallel_size=2" in message, message
        assert "expert_model_parallel_size=2" in message and "nothing was gathered" in message, message
