"""On a GPU with SGLang 0.5.17: a transformers 5 Qwen3-MoE refits into an sglang.Engine through RefitCycle + SglangLink.

transformers 5 holds a layer's experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]); its
checkpoint (``save_pretrained``), and so SGLang's loader, names them per expert (``mlp.experts.{e}.gate_proj.weight``,
...). SGLang fuses them again: ``FusedMoE`` holds ``mlp.experts.w13_weight`` [E, 2I, H] (each expert's gate rows, then
its up rows, with the Triton MoE backend pinned here) and ``w2_weight`` [E, H, I], and its loader copies each expert's
weight into its rows, one ``copy_`` each: refitkit's ``DirectLoads`` learns that and lands every later sync's experts
straight there (``docs/sglang.md``, "Mixture-of-Experts"). The trainer streams ``FSDPAdapter(model).named_weights()``:
checkpoint names, each expert a view of the fused tensor.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from refitkit.engines.fsdp import FSDPAdapter
from refitkit.errors import EngineError, InvalidInput, PartialPush, TransferError
from refitkit.refit import RefitCycle
from refitkit.rollout import SglangLink
from refitkit.rollout.sglang import clean_weight_version, engine_state, push_weights, weight_version
from refitkit.rollout.vllm import tensor_fingerprint
from refitkit.transfer import BucketedWeightSender, WeightVersion
from tests.engines.sglang.sglang_engine import (
    LOGPROB_TOLERANCE,
    PROMPT,
    TIMEOUT_S,
    expected_fingerprints,
    greedy_tokens,
    make_engine,
    reference_greedy,
)

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]

LAYERS, EXPERTS = 2, 8
# embed_tokens, norm, lm_head; per layer: q/k/v/o, q_norm, k_norm, two layernorms, the router, 3 per expert
MOE_HF_NAMES = 3 + LAYERS * (9 + 3 * EXPERTS)
GREEDY_LOGIT_TOLERANCE = LOGPROB_TOLERANCE  # bf16: SGLang's kernels against transformers' eager forward


def moe_config() -> object:
    """The vLLM suite's tiny Qwen3-MoE (``tests/engines/vllm/test_vllm_moe.py``): 2 layers of 8 experts, top-2, expert
    width 64, GQA 2/1 with head_dim 64, vocabulary 256 (no padding in SGLang's embedding)."""
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
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )


def random_moe(seed: int) -> torch.nn.Module:
    """A Qwen3-MoE with every parameter drawn from ``seed`` (norms around 1; a sharp router, so that its top 2 win by
    clear margins the kernels cannot order apart), bf16 on the GPU."""
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(moe_config())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.5 if name.endswith("mlp.gate.weight") else 0.05
            noise = torch.randn(param.shape, generator=generator) * scale
            param.copy_(noise + (1.0 if param.ndim == 1 else 0.0))
    return model.to(device="cuda", dtype=torch.bfloat16).eval()


def trainer_stream(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What a trainer pushes: the FSDP adapter's stream of the model (checkpoint names, experts as views)."""
    return iter(FSDPAdapter(model).named_weights())


def moe_expected(model: torch.nn.Module) -> dict[str, list[int]]:
    """The fingerprints SGLang must hold after a sync of ``model``, from its stream (per-expert checkpoint names stacked
    into ``w13_weight`` / ``w2_weight``), checked first against the trainer's own fused tensors: transformers'
    ``gate_up_proj`` [E, 2I, H] is SGLang's ``w13_weight`` layout as it stands (gate rows first), ``down_proj`` its
    ``w2_weight``."""
    expected = expected_fingerprints(dict(trainer_stream(model)))
    assert len(expected) == 3 + LAYERS * 9  # per layer: qkv, o, q/k norms, 2 layernorms, the router, w13, w2
    fused = {}
    for name, param in model.named_parameters():
        for ours, sglang in (("gate_up_proj", "w13_weight"), ("down_proj", "w2_weight")):
            if name.endswith(f"mlp.experts.{ours}"):
                fused[name.replace(ours, sglang)] = tensor_fingerprint(param)
    assert sorted(fused) == sorted(name for name in expected if name.endswith(("w13_weight", "w2_weight")))
    assert len(fused) == 2 * LAYERS
    assert [name for name, value in fused.items() if expected[name] != value] == []
    return expected


def assert_every_param_is(engine: object, expected: dict[str, list[int]]) -> None:
    """Every parameter SGLang holds, and no other, has ``expected``'s fingerprint (its experts' whole per layer)."""
    held = engine_state(engine, fingerprints=[])["fingerprints"]
    assert sorted(held) == sorted(expected), (sorted(set(held) - set(expected)), sorted(set(expected) - set(held)))
    differing = sorted(name for name in expected if held[name] != expected[name])
    assert differing == [], f"SGLang's params differ from the trainer's: {differing[:8]}"


def assert_greedy_as(model: torch.nn.Module, generated: list[int]) -> None:
    """SGLang's greedy tokens (``generated``, ``greedy_tokens``) are transformers' (``reference_greedy`` of ``model``).
    Both run bf16 with other kernels: a token may differ only where transformers' two best logits, on the sequence
    SGLang generated, are within ``GREEDY_LOGIT_TOLERANCE`` (a near-tie either side may break)."""
    if generated == reference_greedy(model):
        return
    with torch.no_grad():
        sequence = torch.tensor([PROMPT + generated], device="cuda")
        logits = model(sequence).logits[0, len(PROMPT) - 1 : -1].double()
    chosen = logits.gather(1, torch.tensor(generated, device="cuda").unsqueeze(1)).squeeze(1)
    gaps = (logits.max(dim=1).values - chosen).tolist()
    assert max(gaps) <= GREEDY_LOGIT_TOLERANCE, (reference_greedy(model), generated, gaps)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    batch = torch.tensor([PROMPT], device="cuda")
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory, plugin_path):
    """An engine on a tiny bf16 Qwen3-MoE checkpoint, memory saver on, the Triton MoE backend pinned (what ``auto``
    picks on Hopper; on Blackwell ``auto`` picks FlashInfer TRT-LLM, whose post-processing refitkit does not rerun)."""
    from examples.tiny_llama import save_checkpoint

    if not torch.cuda.is_available():
        pytest.skip("SGLang needs a CUDA GPU")
    path = str(tmp_path_factory.mktemp("tiny-qwen3-moe"))
    save_checkpoint(random_moe(seed=0), path)  # (any transformers model: the tokenizer, then save_pretrained)
    engine = make_engine(path, enable_memory_saver=True, moe_runner_backend="triton")
    try:
        yield engine
    finally:
        engine.shutdown()


def test_a_trained_moe_refits_through_the_cycle_for_three_steps_experts_included(moe_engine):
    model = random_moe(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with BucketedWeightSender(
        "sglang-moe-cycle", bucket_bytes=1 << 20, transport="cuda_ipc", timeout_s=TIMEOUT_S
    ) as sender:
        link = SglangLink(moe_engine, sender, sleep_level=2, first_version=700, engine_timeout_s=120.0)
        with RefitCycle(FSDPAdapter(model, optimizer), link) as cycle:
            link.sleep_for_training()
            previous: dict[str, list[int]] = {}
            for step in range(3):
                train_step(model, optimizer)
                held = moe_expected(model)  # read before the refit offloads the trainer's state
                cycle.refit(step)

                assert clean_weight_version(moe_engine) == 700 + step
                [rank] = link.last_push.ranks
                assert (rank["complete"], rank["tensors"], rank["expected"], rank["missing"]) == (
                    True,
                    MOE_HF_NAMES,
                    MOE_HF_NAMES,
                    [],
                )
                if step > 0:  # the first sync watched SGLang's loaders copy each weight once: straight there since
                    assert (rank["direct_tensors"], rank["loader_tensors"]) == (MOE_HF_NAMES, 0), rank
                assert_every_param_is(moe_engine, held)  # w13_weight / w2_weight included
                experts = [name for name in held if name.endswith(("w13_weight", "w2_weight"))]
                assert [name for name in experts if held[name] == previous.get(name)] == []  # the step moved them
                previous = held
                generated = greedy_tokens(moe_engine)
                cycle.resume(step)  # the trainer's state is back: transformers' forward can run
                assert_greedy_as(model, generated)
        link.wake_for_rollout()  # leave the engine serving for the next test (its weights discarded: pushed first)


def test_a_push_missing_one_expert_weight_is_partial_and_names_it(moe_engine):
    trainer = random_moe(seed=1)
    victim = "model.layers.1.mlp.experts.5.up_proj.weight"
    assert victim in dict(trainer_stream(trainer))
    with BucketedWeightSender(
        "sglang-moe-partial", bucket_bytes=1 << 20, transport="cuda_ipc", timeout_s=TIMEOUT_S
    ) as sender:
        push_weights(moe_engine, sender, trainer_stream(trainer), version=80)
        with pytest.raises(PartialPush) as caught:
            stream = ((name, tensor) for name, tensor in trainer_stream(trainer) if name != victim)
            push_weights(moe_engine, sender, stream, version=81)

        partial = caught.value  # bytes landed: not InvalidInput ("before anything moved")
        assert not isinstance(partial, InvalidInput) and isinstance(partial, EngineError)
        assert (partial.version, partial.delivered, partial.expected, partial.engine) == (
            81,
            MOE_HF_NAMES - 1,
            MOE_HF_NAMES,
            "SGLang's TP rank 0",
        )
        assert list(partial.missing) == [victim]
        message = str(partial)
        assert (
            f"the push of version 81 delivered {MOE_HF_NAMES - 1} of the {MOE_HF_NAMES} weights SGLang's TP rank 0 "
            "loads" in message
        )
        assert repr(victim) in message and "reports version 81 as incomplete" in message
        assert weight_version(moe_engine) == WeightVersion(80, 81)
        state = engine_state(moe_engine)["weights"]
        assert (state["clean"], state["received"], state["expected"], state["missing"]) == (
            False,
            MOE_HF_NAMES - 1,
            MOE_HF_NAMES,
            [victim],
        )
        with pytest.raises(TransferError, match=rf"did not deliver 1 weights, e\.g\. \[{victim!r}\]; its last whole "):
            clean_weight_version(moe_engine)

        push_weights(moe_engine, sender, trainer_stream(trainer), version=82)  # a whole push makes it clean again
    assert clean_weight_version(moe_engine) == 82
    assert_every_param_is(moe_engine, moe_expected(trainer))
    assert_greedy_as(trainer, greedy_tokens(moe_engine))
