"""Weight versions in a live vLLM engine: a whole push is clean at its version; a partial or failed one is not."""

from __future__ import annotations

import pytest

from examples.tiny_llama import random_llama
from refitkit.errors import EngineError, InvalidInput, PartialPush, TransferError, UnknownWeight
from refitkit.rollout import WeightVersion, clean_weight_version, weight_versions
from tests.engines.vllm.vllm_checks import (
    LOGPROB_TOLERANCE,
    assert_engine_holds,
    prompt_logprobs,
    push,
    reference_logprobs,
    worker_info,
)

pytestmark = pytest.mark.timeout(300)

HF_NAMES = 21  # the tiny Llama checkpoint: embed, 2 x 9 per layer, norm, lm_head


@pytest.fixture(scope="module")
def trainer():
    return random_llama(seed=1)


def test_a_whole_push_is_clean_at_the_version_it_carried(engine, trainer):
    stats = push(engine, trainer.named_parameters(), version=40)
    assert (stats.ranks[0]["version"], stats.ranks[0]["complete"], stats.ranks[0]["expected"]) == (40, True, HF_NAMES)
    assert weight_versions(engine.llm) == [WeightVersion(40, None)]
    assert clean_weight_version(engine.llm) == 40

    push(engine, engine.original.named_parameters())  # no version given: one above any the worker saw
    assert clean_weight_version(engine.llm) == 41


def test_a_partial_push_of_3_of_21_tensors_is_a_partial_push_not_bad_input(engine, trainer):
    push(engine, trainer.named_parameters(), version=50)
    first_three = list(trainer.named_parameters())[
        :3
    ]  # embed_tokens, layers.0 q_proj and k_proj: what a new user tries

    with pytest.raises(PartialPush) as caught:
        push(engine, first_three, version=51)

    partial = caught.value  # bytes landed: not InvalidInput ("before anything moved")
    assert not isinstance(partial, InvalidInput) and isinstance(partial, EngineError)
    assert (partial.version, partial.delivered, partial.expected, partial.engine) == (51, 3, HF_NAMES, "vLLM worker 0")
    assert len(partial.missing) == 18 and "lm_head.weight" in partial.missing
    assert "model.layers.0.self_attn.q_proj.weight" not in partial.missing
    message = str(partial)
    assert "the push of version 51 delivered 3 of the 21 weights vLLM worker 0 loads" in message
    assert "'lm_head.weight'" in message and "model.layers.0.self_attn.v_proj.weight" not in message.split("missing")[0]
    assert "reports version 51 as incomplete" in message and "push every weight of the checkpoint" in message
    assert weight_versions(engine.llm) == [WeightVersion(50, 51)]
    state = engine.llm.collective_rpc("refit_weight_version")[0]
    assert (state["clean"], state["received"], state["expected"], len(state["missing"])) == (False, 3, HF_NAMES, 18)
    assert "model.layers.0.self_attn.v_proj.weight" in state["missing"]
    assert worker_info(engine.llm)["weights_consistent"] is False
    with pytest.raises(
        TransferError,
        match=r"worker 0's weights are incomplete: sync of version 51 did not land whole; "
        r"it did not deliver 18 weights, .* its last whole sync was version 50",
    ):
        clean_weight_version(engine.llm)

    push(engine, trainer.named_parameters(), version=52)  # the next whole push makes it clean again
    assert clean_weight_version(engine.llm) == 52 and worker_info(engine.llm)["weights_consistent"] is True
    assert prompt_logprobs(engine.llm) == pytest.approx(reference_logprobs(trainer), abs=LOGPROB_TOLERANCE)
    assert_engine_holds(engine, trainer)


def test_a_generator_that_breaks_after_weights_landed_is_a_partial_push_naming_the_bad_item(engine, trainer):
    push(engine, engine.original.named_parameters(), version=55)
    weights = list(trainer.named_parameters())

    def stream():  # twelve good weights (several buckets of 64 KiB: they land), then a bad item
        yield from weights[:12]
        yield "model.layers.1.mlp.up_proj.weight", [1.0]

    with pytest.raises(PartialPush) as caught:
        push(engine, stream(), version=56)
    partial = caught.value
    assert (partial.version, partial.expected, partial.engine) == (56, HF_NAMES, "vLLM worker 0")
    assert 0 < partial.delivered <= 12  # what reached the loader before the stream broke
    assert f"vLLM worker 0 loaded {partial.delivered} of the 21 weights it loads" in str(partial)
    assert "the push of version 56 broke after weights landed (InvalidInput: " in str(partial)
    assert isinstance(partial.__cause__, InvalidInput)  # the bad item, named
    assert "'model.layers.1.mlp.up_proj.weight' is a list, not a torch.Tensor" in str(partial.__cause__)
    assert weight_versions(engine.llm) == [WeightVersion(55, 56)]

    norm = dict(weights)["model.norm.weight"]
    with pytest.raises(InvalidInput, match="is a list, not a torch.Tensor"):  # in the first bucket: nothing moved
        push(engine, iter([("model.norm.weight", norm), ("model.layers.0.input_layernorm.weight", [1.0])]), version=57)
    assert weight_versions(engine.llm) == [WeightVersion(55, 56)]  # untouched by 57
    push(engine, engine.original.named_parameters(), version=58)
    assert weight_versions(engine.llm) == [WeightVersion(58, None)]


def test_a_push_that_fails_part_way_is_incomplete_at_its_version(engine, trainer):
    push(engine, engine.original.named_parameters(), version=60)
    weights = list(trainer.named_parameters())
    bogus = ("model.layers.1.self_attn.bogus.weight", weights[0][1])
    with pytest.raises(UnknownWeight, match="no module or parameter"):
        push(engine, iter(weights[:12] + [bogus] + weights[12:]), version=61)
    assert weight_versions(engine.llm) == [WeightVersion(60, 61)]

    with pytest.raises(InvalidInput, match="is a list, not a torch.Tensor"):  # refused whole: the engine saw nothing
        push(engine, weights[:5] + [("model.norm.weight", [1.0])], version=62)
    assert weight_versions(engine.llm) == [WeightVersion(60, 61)]  # still the failed push's mark

    push(engine, engine.original.named_parameters(), version=63)
    assert weight_versions(engine.llm) == [WeightVersion(63, None)]
    assert prompt_logprobs(engine.llm) == engine.baseline_logprobs
