"""vLLM's own weight-transfer API (``weight_transfer_config={"backend": "refitkit"}``, registered from refitkit's
``vllm.general_plugins`` entry point) receives a refitkit session into the live model, sharing the extension's versions."""

from __future__ import annotations

import concurrent.futures

import pytest

from refitkit.rollout import clean_weight_version
from refitkit.transfer import BucketedWeightSender
from examples.tiny_llama import random_llama
from tests.engines.vllm.vllm_checks import (
    LOGPROB_TOLERANCE, SMALL_BUCKET_BYTES, TIMEOUT_S, assert_engine_holds, prompt_logprobs, push, reference_logprobs,
)  # fmt: skip


def sync_through_vllms_api(llm, weights, *, version: int) -> None:
    """start_weight_update, update_weights (in a thread, as vLLM's HTTP endpoints would) while we send, finish."""
    with BucketedWeightSender("vllm-api", bucket_bytes=SMALL_BUCKET_BYTES, transport="shm", timeout_s=TIMEOUT_S) as sender:
        llm.start_weight_update()
        info = {"endpoint": f"ipc://{sender.path}", "timeout_s": TIMEOUT_S, "version": version}
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            update = pool.submit(llm.update_weights, {"update_info": info})
            try:
                sender.send(weights)
            finally:
                update.result(timeout=TIMEOUT_S)  # a failed update ends vLLM's session: no finish then
        llm.finish_weight_update()


def test_vllms_weight_transfer_api_lands_a_refitkit_session(engine):
    trainer = random_llama(seed=7)
    push(engine, engine.original.named_parameters())

    sync_through_vllms_api(engine.llm, trainer.named_parameters(), version=77)

    assert_engine_holds(engine, trainer)
    assert prompt_logprobs(engine.llm) == pytest.approx(reference_logprobs(trainer), abs=LOGPROB_TOLERANCE)
    assert clean_weight_version(engine.llm) == 77  # the extension reads the engine's receiver: one record of versions


def test_a_partial_session_fails_update_weights_and_leaves_the_engine_incomplete(engine):
    weights = list(random_llama(seed=8).named_parameters())
    with pytest.raises(Exception, match=r"refitkit: the sync of version 78 delivered 10 of the 21 weights"):
        sync_through_vllms_api(engine.llm, weights[:10], version=78)
    with pytest.raises(Exception, match="sync of version 78 did not land whole"):
        clean_weight_version(engine.llm)

    push(engine, engine.original.named_parameters(), version=79)
    assert clean_weight_version(engine.llm) == 79
    assert prompt_logprobs(engine.llm) == engine.baseline_logprobs


def test_bad_update_info_is_refused_naming_the_field(engine):
    engine.llm.start_weight_update()
    with pytest.raises(Exception, match="refitkit update_info: endpoint must be a str, got a int"):
        engine.llm.update_weights({"update_info": {"endpoint": 5}})
    engine.llm.start_weight_update()  # the failed update ended vLLM's session: a new one starts
    with pytest.raises(Exception, match="give exactly one of endpoint= .* or rendezvous="):
        engine.llm.update_weights({"update_info": {}})
