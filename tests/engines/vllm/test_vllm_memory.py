"""On a GPU: VllmLink drives a sleep-mode vLLM engine's memory around RefitCycle, refuses what would crash or OOM it."""

from __future__ import annotations

import time

import pytest
import torch

from examples.tiny_llama import random_llama, save_checkpoint
from refitkit.engines.fsdp import FSDPAdapter
from refitkit.errors import EngineAsleep, KVCacheWontFit
from refitkit.refit import RefitCycle
from refitkit.rollout import VllmLink, clean_weight_version, push_weights, weight_versions
from refitkit.rollout.links import EngineMemory
from refitkit.transfer import BucketedWeightSender
from tests.engines.vllm.vllm_checks import (
    LOGPROB_TOLERANCE,
    PROMPT,
    TIMEOUT_S,
    engine_checksums,
    expected_engine_checksums,
    prompt_logprobs,
    reference_logprobs,
)

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def sleepy(tmp_path_factory):
    """A second live engine, with sleep mode (weights and KV cache in vLLM's CuMemAllocator)."""
    from vllm import LLM

    if not torch.cuda.is_available():
        pytest.skip("sleep mode needs GPU vLLM")
    path = str(tmp_path_factory.mktemp("tiny-llama-sleepy"))
    save_checkpoint(random_llama(seed=0), path)
    llm = LLM(
        model=path,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        max_model_len=128,
        gpu_memory_utilization=0.1,
        enable_sleep_mode=True,
        worker_extension_cls="refitkit.rollout.vllm.RefitWorkerExtension",
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()


def memory(llm) -> dict:
    return llm.collective_rpc("refit_memory")[0]


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    batch = torch.tensor([PROMPT], device="cuda")
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("level", [1, 2])
def test_the_link_sleeps_and_wakes_the_engine_around_the_cycle(sleepy, level):
    model = random_llama(seed=20 + level).to("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with BucketedWeightSender(
        f"vllm-sleepy-{level}", bucket_bytes=1 << 20, transport="cuda_ipc", timeout_s=TIMEOUT_S
    ) as sender:
        link = VllmLink(sleepy, sender, sleep_level=level, first_version=10 * level, engine_timeout_s=60.0)
        with RefitCycle(FSDPAdapter(model, optimizer), link) as cycle:
            link.sleep_for_training()  # the engine served; the trainer's state is on the device: its first step
            asleep = memory(sleepy)["asleep"]
            assert asleep["weights"] > 0 and asleep["kv_cache"] > 0 and link.memory is EngineMemory.ASLEEP
            if level == 2:  # the weights were discarded: the engine says so until a full sync lands
                assert not weight_versions(sleepy)[0].clean
            for step in range(2):
                train_step(model, optimizer)
                expected = reference_logprobs(model)
                held = expected_engine_checksums(model)
                report = cycle.refit(step)

                names = [phase.name for phase in report.phases]
                assert names == [
                    "engine_wake_weights",
                    "sync_weights",
                    "offload",
                    "flush_device",
                    "barrier",
                    "engine_wake_kv_cache",
                ]
                state = memory(sleepy)
                assert (
                    state["asleep"] == {} and state["resident"]["kv_cache"] == asleep["kv_cache"]
                )  # all of it came back
                assert link.memory is EngineMemory.SERVING
                assert engine_checksums(sleepy) == held  # bit for bit what the trainer held
                assert prompt_logprobs(sleepy) == pytest.approx(expected, abs=LOGPROB_TOLERANCE)
                assert clean_weight_version(sleepy) == 10 * level + step

                resumed = cycle.resume(step)
                assert [phase.name for phase in resumed.phases] == ["engine_sleep", "reload", "barrier"]
                assert link.memory is EngineMemory.ASLEEP and memory(sleepy)["asleep"]["kv_cache"] == asleep["kv_cache"]
        link.wake_for_rollout()  # leave the engine serving for the next test
    assert link.memory is EngineMemory.SERVING


def test_a_push_into_sleeping_weights_is_refused_not_a_crash(sleepy):
    trainer = random_llama(seed=30).to("cuda")
    sleepy.sleep(level=1)  # by hand: the link did not see it
    try:
        with BucketedWeightSender(
            "vllm-sleepy-push", bucket_bytes=1 << 20, transport="cuda_ipc", timeout_s=TIMEOUT_S
        ) as sender:
            began = time.monotonic()
            with pytest.raises(EngineAsleep, match=r"weights are asleep .*wake_up\(tags=\['weights'\]\)"):
                push_weights(sleepy, sender, trainer.named_parameters())
            assert time.monotonic() - began < TIMEOUT_S / 2  # refused by the worker, not found by a timeout
        assert memory(sleepy)["asleep"]["weights"] > 0
    finally:
        sleepy.wake_up()
    assert len(prompt_logprobs(sleepy)) == len(PROMPT) - 1  # the engine still serves


def test_a_kv_cache_that_cannot_fit_is_refused_with_the_bytes(sleepy):
    trainer = random_llama(seed=31).to("cuda")
    with BucketedWeightSender(
        "vllm-sleepy-kv", bucket_bytes=1 << 20, transport="cuda_ipc", timeout_s=TIMEOUT_S
    ) as sender:
        link = VllmLink(sleepy, sender, sleep_level=1, engine_timeout_s=60.0)
        link.sleep_for_training()
        link.send(trainer.named_parameters())  # wakes the weights first
        state = memory(sleepy)
        needed = state["asleep"]["kv_cache"]
        # The trainer keeps its state: all but half the KV cache's bytes of the device's free memory.
        hog = torch.empty(state["free_bytes"] - needed // 2, dtype=torch.uint8, device="cuda")
        try:
            with pytest.raises(KVCacheWontFit, match=r"needs \d+ MiB .* has \d+ MiB free") as caught:
                link.wake_for_rollout()
            assert caught.value.needed_bytes == needed and caught.value.free_bytes < needed
            assert link.memory is EngineMemory.WEIGHTS_AWAKE and memory(sleepy)["asleep"]["kv_cache"] == needed
        finally:
            del hog
            torch.cuda.empty_cache()
        link.wake_for_rollout()  # the trainer let go: now it fits
        assert link.memory is EngineMemory.SERVING and memory(sleepy)["asleep"] == {}
        assert engine_checksums(sleepy) == expected_engine_checksums(trainer)
        assert prompt_logprobs(sleepy) == pytest.approx(reference_logprobs(trainer), abs=LOGPROB_TOLERANCE)
