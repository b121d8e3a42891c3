"""On a GPU: the trainer's CUDA weights reach vLLM through CUDA IPC, bit-exactly.

(That the sender's IPC bucket is freed, whatever the receiver does, is tests/transfer/test_cuda.py's job.)
"""

from __future__ import annotations

import pytest

from examples.tiny_llama import random_llama
from refitkit.rollout.vllm import push_weights
from refitkit.transfer import BucketedWeightSender
from tests.engines.vllm.vllm_checks import (
    LOGPROB_TOLERANCE,
    TIMEOUT_S,
    assert_engine_holds,
    prompt_logprobs,
    reference_logprobs,
    worker_info,
)

pytestmark = pytest.mark.cuda


def test_cuda_ipc_push_lands_bit_exactly(engine):
    trainer = random_llama(seed=2).to("cuda")
    with BucketedWeightSender(
        "vllm-refit-cuda", bucket_bytes=1 << 20, transport="cuda_ipc", timeout_s=TIMEOUT_S
    ) as sender:
        stats = push_weights(engine.llm, sender, trainer.named_parameters())
    assert stats.sender.tensors == len(list(trainer.parameters())) == stats.ranks[0]["tensors"]
    assert worker_info(engine.llm)["device"].startswith("cuda")

    assert_engine_holds(engine, trainer)  # every parameter, stacked as vLLM stacks them, bit for bit
    assert prompt_logprobs(engine.llm) == pytest.approx(reference_logprobs(trainer), abs=LOGPROB_TOLERANCE)

    original = engine.original.to("cuda")
    try:
        with BucketedWeightSender(
            "vllm-refit-cuda", bucket_bytes=1 << 20, transport="cuda_ipc", timeout_s=TIMEOUT_S
        ) as sender:
            again = push_weights(engine.llm, sender, original.named_parameters())
    finally:
        engine.original.to("cpu")
    assert prompt_logprobs(engine.llm) == engine.baseline_logprobs  # the same state as vLLM's own disk load
    # That second push went straight into the params, learned from the first (one copy, no loader):
    [worker] = again.ranks
    assert worker["direct_tensors"] > 0 and worker["direct_tensors"] + worker["loader_tensors"] == worker["tensors"]
    assert worker["direct_bytes"] + worker["loader_bytes"] == worker["bytes"]


def test_a_direct_push_reads_the_trainers_weights_in_place_bit_exact_and_leaves_nothing_mapped(engine):
    """direct=True into the live engine: vLLM's workers load from views of the trainer's own allocations, release
    every mapping before the final ACK, and the trainer's device memory is exactly what it was."""
    import torch

    from tests.transfer.harness import assert_device_memory_back, device_free_bytes

    trainer = random_llama(seed=4).to("cuda")
    for round_index in range(3):  # the first makes the engine's temporaries; the rest are the one-copy arrival
        torch.cuda.synchronize()
        reserved, free = torch.cuda.memory_reserved(), device_free_bytes()
        with BucketedWeightSender(
            "vllm-refit-direct", bucket_bytes=1 << 20, transport="cuda_ipc", timeout_s=TIMEOUT_S, direct=True
        ) as sender:
            stats = push_weights(engine.llm, sender, trainer.named_parameters())
            split = sender.last_split
        assert torch.cuda.memory_reserved() == reserved
        if round_index:
            assert_device_memory_back(free, f"direct push {round_index + 1} into vLLM")
        params = list(trainer.parameters())
        assert (split.direct_tensors, split.bucket_tensors, split.bucket_reasons) == (len(params), 0, {})
        assert split.direct_bytes == sum(p.nbytes for p in params) and stats.ranks[0]["tensors"] == len(params)
        assert_engine_holds(engine, trainer)
    assert prompt_logprobs(engine.llm) == pytest.approx(reference_logprobs(trainer), abs=LOGPROB_TOLERANCE)


def test_gloo_broadcast_of_cuda_weights_lands_bit_exactly(engine):
    """One GPU: the gloo path with CUDA tensors on both sides (staged through the host), as a disaggregated run would."""
    from refitkit.rollout import clean_weight_version, push_weights_broadcast
    from refitkit.transfer import BroadcastWeightSender
    from tests.engines.vllm.vllm_checks import SECRET, free_port

    trainer = random_llama(seed=3).to("cuda")
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    with BroadcastWeightSender(
        rendezvous, secret=SECRET, receivers=1, bucket_bytes=1 << 20, device="cuda", backend="gloo", timeout_s=TIMEOUT_S
    ) as sender:
        stats = push_weights_broadcast(engine.llm, sender, trainer.named_parameters(), secret=SECRET, version=900)
    [worker] = stats.ranks
    assert (worker["version"], worker["complete"], worker["tensors"]) == (900, True, len(list(trainer.parameters())))
    assert clean_weight_version(engine.llm) == 900
    assert_engine_holds(engine, trainer)
    assert prompt_logprobs(engine.llm) == pytest.approx(reference_logprobs(trainer), abs=LOGPROB_TOLERANCE)
