"""Weights pushed from a trainer copy through BucketedWeightSender land in a live vLLM engine."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch

from examples.tiny_llama import random_llama
from refitkit.errors import EngineError, InvalidInput, PartialPush, TransferError, UnknownWeight, WeightShapeMismatch
from refitkit.rollout._push import peer_error
from refitkit.rollout.vllm import push_weights
from refitkit.transfer import BucketedWeightSender
from tests.engines.vllm.vllm_checks import (
    LOGPROB_TOLERANCE,
    TIMEOUT_S,
    assert_engine_holds,
    prompt_logprobs,
    push,
    reference_logprobs,
    worker_info,
)
from tests.transfer.peers import mapped_segments


@pytest.fixture(scope="module")
def trainer() -> torch.nn.Module:
    """The trainer's copy: same architecture as the engine's checkpoint, different random weights."""
    return random_llama(seed=1)


def test_push_replaces_the_weights_vllm_computes_with(engine, trainer):
    push(engine, engine.original.named_parameters())
    before = prompt_logprobs(engine.llm)
    expected = reference_logprobs(trainer)
    assert max(abs(a - b) for a, b in zip(before, expected)) > 0.05  # the two weight sets are distinguishable

    stats = push(engine, trainer.named_parameters())

    after = prompt_logprobs(engine.llm)
    assert after == pytest.approx(expected, abs=LOGPROB_TOLERANCE)
    assert_engine_holds(engine, trainer)
    sent_bytes = sum(param.nbytes for param in trainer.parameters())
    assert stats.sender.tensors == len(list(trainer.parameters())) and stats.sender.bytes == sent_bytes
    assert stats.sender.buckets > 4  # the small bucket really was reused many times
    [worker] = stats.ranks
    assert (worker["tensors"], worker["bytes"], worker["buckets"]) == (
        stats.sender.tensors,
        sent_bytes,
        stats.sender.buckets,
    )
    assert all(
        isinstance(value, (int, float, bool, list, str)) or value is None for value in worker.values()
    )  # plain values crossed the rpc
    assert worker["load_path"] in ("in_place", "layerwise")
    assert (worker["complete"], worker["missing"], worker["expected"]) == (True, [], 21)


def test_pushing_the_checkpoint_back_restores_vllms_own_load_bit_exactly(engine, trainer):
    push(engine, trainer.named_parameters())
    push(engine, engine.original.named_parameters(), bucket_bytes=1 << 20)

    assert prompt_logprobs(engine.llm) == engine.baseline_logprobs  # bit-exact: same state as vLLM's disk load
    assert_engine_holds(engine, engine.original)


@pytest.mark.parametrize("position", [8, None], ids=["mid-stream", "last"])
def test_unknown_name_fails_naming_it_and_the_engine_recovers(engine, trainer, position):
    """Mid-stream the sender hears of it first; as the last weight, only the worker's rpc does (the stream ended):
    either way an ``UnknownWeight`` naming the weight, the worker and the phase, vLLM's own error carried as data."""
    weights = list(trainer.named_parameters())
    bogus = ("model.layers.0.self_attn.bogus.weight", torch.zeros(4, 4))
    began = time.monotonic()
    with pytest.raises(UnknownWeight) as caught:
        push(engine, weights + [bogus] if position is None else weights[:position] + [bogus] + weights[position:])
    elapsed_s = time.monotonic() - began

    assert elapsed_s < TIMEOUT_S  # reported by the worker, not found by a timeout
    error = caught.value
    assert str(error).startswith(
        "vLLM worker 0 has no parameter for pushed weight 'model.layers.0.self_attn.bogus.weight' (shape [4, 4]; the "
        "checkpoint it loaded has no such name): its loader raised ValueError: There is no module or parameter named "
        "'layers.0.self_attn.bogus'"
    )
    assert "The weights before it were loaded, so the engine reports its weights incomplete" in str(error)
    assert (error.weight, error.shape, error.expected_shape, error.engine) == (bogus[0], (4, 4), None, "vLLM worker 0")
    in_place = torch.cuda.is_available()
    assert error.phase == ("loading in place (the model's load_weights)" if in_place else "vLLM's layerwise reload")
    assert error.remote_type == "ValueError"
    assert "no module or parameter named 'layers.0.self_attn.bogus'" in error.remote_message
    assert isinstance(error.__cause__, TransferError)  # the sender heard it first, from the receiver's report
    if torch.cuda.is_available():  # in place: vLLM's loader raised inside on_bucket
        assert "on_bucket raised ValueError" in str(error.__cause__)
    else:  # layerwise: the receiver's stream ended with the refusal, which crossed as its code and fields
        assert type(peer_error(error.__cause__)) is UnknownWeight
        assert peer_error(error.__cause__).weight == bogus[0]
        assert "receiver gave up after" in str(error.__cause__)
    assert mapped_segments(worker_info(engine.llm)["pid"]) == []  # the worker unmapped the bucket
    assert worker_info(engine.llm)["weights_consistent"] is False  # half old, half new: flagged
    assert len(prompt_logprobs(engine.llm)) == len(engine.baseline_logprobs)  # the engine still serves

    push(engine, trainer.named_parameters())  # a retry after the failure lands completely
    assert worker_info(engine.llm)["weights_consistent"] is True
    assert prompt_logprobs(engine.llm) == pytest.approx(reference_logprobs(trainer), abs=LOGPROB_TOLERANCE)
    assert_engine_holds(engine, trainer)


@pytest.mark.parametrize(
    "victim", ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight", "lm_head.weight"]
)
def test_a_weight_of_the_wrong_shape_fails_naming_it_and_both_shapes(engine, trainer, victim):
    """A q_proj with a row too many loaded silently into vLLM (its loader cuts it to fit), a down_proj failed with an
    empty message, the last weight (lm_head) as a bare ``Exception``: each is refused before vLLM's loader sees it."""
    weights = list(trainer.named_parameters())
    index = [name for name, _ in weights].index(victim)
    good = weights[index][1]
    weights[index] = (victim, torch.zeros(good.shape[0] + 1, good.shape[1]))
    began = time.monotonic()
    with pytest.raises(WeightShapeMismatch) as caught:
        push(engine, weights)
    assert time.monotonic() - began < TIMEOUT_S

    error, expected = caught.value, [good.shape[0], good.shape[1]]
    pushed = [expected[0] + 1, expected[1]]
    assert isinstance(error, EngineError) and not isinstance(error, InvalidInput)  # bytes had moved: the engine's
    assert str(error).startswith(
        f"vLLM worker 0 refused weight {victim!r}: pushed with shape {pushed}, but the checkpoint "
        f"it loaded has {expected} (phase: shape check, before loading it). The weights before it were loaded"
    )
    assert (error.weight, error.shape, error.expected_shape) == (victim, tuple(pushed), tuple(expected))
    assert (error.engine, error.phase, error.remote_type) == ("vLLM worker 0", "shape check", None)
    info = worker_info(engine.llm)
    assert info["weights_consistent"] is False and mapped_segments(info["pid"]) == []

    push(engine, trainer.named_parameters())  # a full push repairs it
    assert worker_info(engine.llm)["weights_consistent"] is True
    assert_engine_holds(engine, trainer)


def test_a_bad_item_in_a_list_is_refused_before_the_engine_sees_a_byte(engine, trainer):
    push(engine, engine.original.named_parameters())
    weights = list(trainer.named_parameters())
    began = time.monotonic()
    with pytest.raises(InvalidInput, match="'model.layers.1.mlp.up_proj.weight' is a list, not a torch.Tensor"):
        push(engine, weights[:10] + [("model.layers.1.mlp.up_proj.weight", [1.0, 2.0])] + weights[10:])
    assert time.monotonic() - began < 5.0  # no worker waited for a session
    info = worker_info(engine.llm)
    assert info["weights_consistent"] is True and mapped_segments(info["pid"]) == []
    assert prompt_logprobs(engine.llm) == engine.baseline_logprobs  # not one weight changed


def test_a_bad_item_mid_stream_is_a_partial_push_from_the_invalid_input_naming_it(engine, trainer):
    weights = list(trainer.named_parameters())
    began = time.monotonic()
    with pytest.raises(PartialPush, match="broke after weights landed") as caught:  # earlier buckets had landed
        push(engine, iter(weights[:10] + [("model.layers.1.mlp.up_proj.weight", [1.0, 2.0])] + weights[10:]))
    assert time.monotonic() - began < TIMEOUT_S
    assert isinstance(caught.value.__cause__, InvalidInput)
    assert "'model.layers.1.mlp.up_proj.weight' is a list, not a torch.Tensor" in str(caught.value.__cause__)
    info = worker_info(engine.llm)
    assert info["weights_consistent"] is False and mapped_segments(info["pid"]) == []

    push(engine, engine.original.named_parameters())
    assert prompt_logprobs(engine.llm) == engine.baseline_logprobs
    assert worker_info(engine.llm)["weights_consistent"] is True


def test_a_non_iterable_is_rejected_before_the_worker_waits(engine):
    began = time.monotonic()
    with BucketedWeightSender("vllm-refit-none", transport="shm", timeout_s=TIMEOUT_S) as sender:
        with pytest.raises(InvalidInput, match="weights is a int"):
            push_weights(engine.llm, sender, 42)
    assert time.monotonic() - began < 5.0


def test_refit_receive_without_a_sender_times_out_within_its_bound(engine, trainer, tmp_path):
    push(engine, trainer.named_parameters())
    endpoint = f"ipc://{tmp_path}/nobody.sock"
    began = time.monotonic()
    with pytest.raises(Exception, match=r"handshake: no setup from the sender on .*nobody\.sock.* within timeout_s=1 "):
        engine.llm.collective_rpc("refit_receive", args=(endpoint, 1.0))  # vLLM re-raises worker errors as Exception
    assert time.monotonic() - began < 15.0
    assert worker_info(engine.llm)["weights_consistent"] is True  # nothing arrived: the last push still stands
    assert prompt_logprobs(engine.llm) == pytest.approx(reference_logprobs(trainer), abs=LOGPROB_TOLERANCE)


def test_raw_rpc_with_a_per_rank_endpoint(engine, trainer):
    """Without push_weights: the rpc runs in a thread while the sender sends; ``{rank}`` names rank 0's sender."""
    with BucketedWeightSender("vllm-rank-0", bucket_bytes=1 << 20, transport="shm", timeout_s=TIMEOUT_S) as sender:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            rpc = pool.submit(
                engine.llm.collective_rpc, "refit_receive", timeout=TIMEOUT_S, args=("vllm-rank-{rank}", TIMEOUT_S)
            )
            sent = sender.send(trainer.named_parameters())
            [received] = rpc.result(timeout=TIMEOUT_S)
    assert (received["tensors"], received["bytes"]) == (sent.tensors, sent.bytes)
    assert_engine_holds(engine, trainer)


def test_checksums_of_an_unknown_parameter_name_it(engine):
    with pytest.raises(Exception, match=r"no parameter\(s\) \['model.nope.weight'\] in the vLLM model"):
        engine.llm.collective_rpc("refit_checksums", args=(["model.nope.weight"],))


def test_push_weights_rejects_a_bad_timeout(engine):
    with BucketedWeightSender("vllm-refit-bad", transport="shm", timeout_s=TIMEOUT_S) as sender:
        with pytest.raises(InvalidInput, match="timeout_s=0"):
            push_weights(engine.llm, sender, [], timeout_s=0)


def test_the_load_path_is_in_place_on_gpu_and_layerwise_on_vllm_cpu(engine, trainer):
    push(engine, trainer.named_parameters())
    info = worker_info(engine.llm)
    # GPU vLLM, unquantized layers: the loaders copy each bucket view once into the params (no clone, no re-buffering);
    # vllm-cpu repacks linear weights after loading, so there every sync is a layerwise reload of clones.
    assert info["load_path"] == ("in_place" if torch.cuda.is_available() else "layerwise")
    assert_engine_holds(engine, trainer)
