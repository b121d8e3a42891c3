"""The engine-neutral core of a push (``refitkit.rollout._push``): one set of knobs for both engines, one ``PushStats``,
and errors that cross from an engine rank as typed values (a code and fields), never read out of text."""

from __future__ import annotations

import inspect
import json
import threading
import time

import msgpack
import pytest
import torch

from refitkit._knobs import RENAMED_KNOBS, renamed_knob
from refitkit.errors import (
    CROSSING,
    EngineAsleep,
    EngineError,
    InvalidInput,
    KVCacheWontFit,
    PartialPush,
    RemoteError,
    TransferError,
    TransferTimeout,
    WeightRejected,
    WeightShapeMismatch,
    error_from_record,
    error_record,
)
from refitkit.rollout import PushStats, SglangLink, SglangPushStats, VllmLink, VllmPushStats, sglang, vllm
from refitkit.rollout._push import EngineCall, drive, partial_push, peer_error, rank_error
from refitkit.rollout.sessions import HELPER_THREAD_PREFIX, HelperThreads, refuse_session
from refitkit.transfer import BucketedWeightReceiver, BucketedWeightSender
from refitkit.transfer.protocol import failure_fields

pytestmark = pytest.mark.timeout(60)


# -- one knob, one name: the same concept is spelt and defaulted alike on both engines -------------------------------

ENTRY_POINTS = [
    (vllm.push_weights, sglang.push_weights),
    (vllm.push_weights_broadcast, sglang.push_weights_broadcast),
    (VllmLink.__init__, SglangLink.__init__),
]


def _knobs(function) -> list[tuple[str, object, object]]:
    """Each parameter after the engine's own object (an ``LLM``, an ``sglang.Engine``), as (name, kind, default); a
    former spelling still taken for one release (``RENAMED_KNOBS``) is left out."""
    parameters = list(inspect.signature(function).parameters.values())
    parameters = parameters[2:] if parameters[0].name == "self" else parameters[1:]
    return [(p.name, p.kind, p.default) for p in parameters if p.name not in RENAMED_KNOBS]


@pytest.mark.parametrize("for_vllm,for_sglang", ENTRY_POINTS, ids=lambda function: function.__qualname__)
def test_both_engines_push_and_link_with_the_same_knobs_and_defaults(for_vllm, for_sglang):
    assert _knobs(for_vllm) == _knobs(for_sglang)
    returned = {inspect.signature(function).return_annotation for function in (for_vllm, for_sglang)}
    assert returned in ({"PushStats"}, {"None"})


def test_the_prefix_cache_and_the_memory_have_one_name_each_and_one_default():
    for for_vllm, for_sglang in ENTRY_POINTS[:2]:
        for function in (for_vllm, for_sglang):
            assert inspect.signature(function).parameters["reset_prefix_cache"].default is True
    for link in (VllmLink, SglangLink):
        assert inspect.signature(link.__init__).parameters["sleep_level"].default is None
    assert RENAMED_KNOBS == {"flush_cache": "reset_prefix_cache", "release_memory": "sleep_level"}


def test_a_former_spelling_still_works_for_one_release_and_names_the_new_one():
    class Engine:  # only the shape push_weights checks before it asks the engine anything (it never does here)
        server_args = type("Args", (), {"tp_size": 1, "dp_size": 1, "pp_size": 1})()

        def update_weights_from_ipc(self, **kwargs):
            raise AssertionError("not called: the list is refused first")

        release_memory_occupation = resume_memory_occupation = update_weights_from_ipc

    with BucketedWeightSender("push-core", transport="shm", timeout_s=5.0) as sender:
        with pytest.warns(DeprecationWarning, match=r"flush_cache= is deprecated: use reset_prefix_cache="):
            with pytest.raises(
                InvalidInput, match="is a list, not a torch.Tensor"
            ):  # refused before the engine is asked
                sglang.push_weights(Engine(), sender, [("w", [1.0])], flush_cache=False)
    with pytest.warns(DeprecationWarning):
        assert renamed_knob("reset_prefix_cache", True, default=True, old="flush_cache", old_value=False) is False
    assert renamed_knob("reset_prefix_cache", False, default=True, old="flush_cache", old_value=None) is False


def test_one_push_stats_for_both_engines_and_the_old_names_still_read():
    stats = PushStats(sender=None, ranks=[{"version": 3}, {"version": 3, "rank": 1}])  # type: ignore[arg-type]
    assert VllmPushStats is PushStats is SglangPushStats
    with pytest.warns(DeprecationWarning, match="use PushStats.ranks"):
        assert stats.workers == stats.ranks
    with pytest.warns(DeprecationWarning, match="use PushStats.ranks"):
        assert stats.scheduler == {"version": 3, "tp_ranks": stats.ranks}  # SGLang's TP rank 0, every rank under it


# -- errors as typed values -----------------------------------------------------------------------------------------

RECORDED = [
    EngineAsleep("weights asleep"),
    KVCacheWontFit("no room", needed_bytes=5 << 30, free_bytes=3 << 30),
    WeightShapeMismatch(
        "refused", weight="w", shape=(3, 2), expected_shape=(2, 2), engine="vLLM worker 1", phase="shape check"
    ),
    PartialPush("partial", version=7, delivered=3, expected=21, missing=("a", "b"), engine="SGLang's TP rank 0"),
    TransferTimeout("silent", remote_message=None, remote_type=None, remote_traceback=None),
]


@pytest.mark.parametrize("error", RECORDED, ids=lambda error: type(error).__name__)
@pytest.mark.parametrize("codec", ["json", "msgpack"])
def test_an_error_crosses_as_its_code_and_fields_through_either_codec(error, codec):
    record = error_record(error)
    carried = (
        json.loads(json.dumps(record))
        if codec == "json"
        else msgpack.unpackb(msgpack.packb(record), strict_map_key=True)
    )
    rebuilt = error_from_record(carried["error_code"], str(error), carried["error_fields"])
    assert type(rebuilt) is type(error) and str(rebuilt) == str(error)
    assert {name: getattr(rebuilt, name) for name in type(error).fields} == {
        name: getattr(error, name) for name in type(error).fields
    }


def test_a_record_that_is_not_one_of_ours_is_refused_not_guessed():
    fields = error_record(RECORDED[1])["error_fields"]
    assert error_from_record("KVCacheWontFit", "x", {**fields, "free_bytes": {"a": 1}}) is None  # not a plain value
    assert error_from_record("KVCacheWontFit", "x", {"needed_bytes": 1}) is None  # a field missing
    assert error_from_record("KVCacheWontFit", "x", {**fields, "more": 1}) is None  # a field it does not have
    assert error_from_record("SystemExit", "x", {}) is None and error_from_record(None, "x", {}) is None
    assert error_record(KeyError("x")) == {} and error_record(RemoteError("T", "m")) == {}
    assert set(CROSSING) >= {"EngineAsleep", "WeightRejected", "UnknownWeight", "WeightShapeMismatch", "PartialPush"}


def _rank(error: Exception) -> dict:
    return {"failure": json.loads(json.dumps(failure_fields(error))), "weights": None}


def test_a_ranks_failure_comes_back_as_its_type_whatever_its_message_says():
    worker = lambda rank: f"vLLM worker {rank}"  # noqa: E731
    mismatch = WeightShapeMismatch(
        "vLLM worker 1 refused 'w'",
        weight="w",
        shape=(3, 2),
        expected_shape=(2, 2),
        engine="vLLM worker 1",
        phase="shape check",
    )
    rebuilt = rank_error([{"version": 1}, _rank(mismatch)], [1], what="vLLM's refit_receive", rank_name=worker)
    assert type(rebuilt) is WeightShapeMismatch and str(rebuilt) == "vLLM worker 1 refused 'w'"  # it names the rank
    assert (rebuilt.weight, rebuilt.shape, rebuilt.expected_shape, rebuilt.phase) == (
        "w",
        (3, 2),
        (2, 2),
        "shape check",
    )
    assert isinstance(rebuilt.__cause__, RemoteError)  # the rank's own exception, as its report described it
    assert rebuilt.__cause__.remote_type == "refitkit.errors.WeightShapeMismatch"

    asleep = rank_error([_rank(EngineAsleep("weights asleep"))], [0], what="vLLM's refit_receive", rank_name=worker)
    assert type(asleep) is EngineAsleep
    assert str(asleep) == "vLLM worker 0 in vLLM's refit_receive raised EngineAsleep: weights asleep"
    words = rank_error([_rank(RuntimeError("EngineAsleep? no: out of memory"))], [0], what="a call", rank_name=worker)
    assert type(words) is EngineError  # its message names a type: not read as one
    assert str(words) == "vLLM worker 0 in a call raised RuntimeError: EngineAsleep? no: out of memory"
    both = rank_error(
        [_rank(EngineAsleep("one")), _rank(KeyError("x"))],
        [0, 1],
        what="SGLang's receive",
        rank_name=lambda rank: f"SGLang's TP rank {rank}",
    )
    assert type(both) is EngineAsleep and str(both).endswith(
        "raised EngineAsleep: one; SGLang's TP rank 1: KeyError: 'x'"
    )


def test_a_partial_push_names_how_many_of_how_many_landed_the_version_and_what_to_do():
    whole = partial_push("vLLM worker 0", version=51, expected=21, missing=tuple(f"w{i}" for i in range(18)))
    assert (whole.delivered, whole.expected, whole.version, len(whole.missing)) == (3, 21, 51, 18)
    assert str(whole) == (
        "the push of version 51 delivered 3 of the 21 weights vLLM worker 0 loads; missing "
        "['w0', 'w1', 'w2', 'w3', 'w4', 'w5', 'w6', 'w7'] and 10 more. The weights that landed stay loaded, so the engine "
        "reports version 51 as incomplete until a full push lands: push every weight of the checkpoint (its Hugging Face "
        "names) again"
    )
    broke = partial_push("vLLM worker 0", version=None, expected=21, delivered=7, broke="InvalidInput: bad item")
    assert str(broke).startswith(
        "the push of its version broke after weights landed (InvalidInput: bad item): vLLM worker 0 loaded 7 of the 21 "
        "weights it loads. "
    )
    unknown = partial_push("vLLM's workers", version=4, expected=21, broke="RuntimeError: gather failed")
    assert unknown.delivered is None and "may have loaded some of the 21 weights it loads" in str(unknown)
    assert isinstance(whole, EngineError) and not isinstance(whole, InvalidInput)


# -- over refitkit's own wire: a receiver's refusal reaches the sender as its type and fields ----------------------


def _refuse_in_a_thread(endpoint: str, error: Exception) -> threading.Thread:
    def refuse() -> None:
        try:
            refuse_session(BucketedWeightReceiver(endpoint, torch.device("cpu"), timeout_s=10.0), error)
        except Exception:  # (raised here too, after the sender heard it)
            pass

    thread = threading.Thread(target=refuse, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(
    "refusal",
    [
        EngineAsleep("the weights are asleep"),
        KVCacheWontFit("the KV cache would not fit", needed_bytes=7 << 20, free_bytes=1 << 20),
    ],
    ids=lambda error: type(error).__name__,
)
def test_a_receivers_refusal_reaches_the_sender_as_its_type_and_fields(refusal):
    with BucketedWeightSender("push-core-wire", transport="shm", timeout_s=10.0) as sender:
        thread = _refuse_in_a_thread(f"ipc://{sender.path}", refusal)
        with pytest.raises(TransferError) as caught:
            sender.send([("w", torch.ones(4))])
        thread.join(timeout=10)
    typed = peer_error(caught.value)
    assert type(typed) is type(refusal) and str(typed) == str(refusal)
    assert {name: getattr(typed, name) for name in type(refusal).fields} == {
        name: getattr(refusal, name) for name in type(refusal).fields
    }
    assert caught.value.__cause__.error is typed


def test_a_receivers_other_exception_is_not_read_as_a_refusal_by_its_words():
    with BucketedWeightSender("push-core-wire", transport="shm", timeout_s=10.0) as sender:
        thread = _refuse_in_a_thread(f"ipc://{sender.path}", RuntimeError("EngineAsleep, says the text"))
        with pytest.raises(TransferError, match="EngineAsleep, says the text") as caught:
            sender.send([("w", torch.ones(4))])
        thread.join(timeout=10)
    assert peer_error(caught.value) is None and caught.value.remote_type == "RuntimeError"


def test_a_failed_push_waits_for_the_reset_it_asked_for_and_leaves_no_helper_thread():
    """A push whose receiver refused a weight raises only once the prefix-cache reset it queued after the hello has
    ended: a one-shot push leaves no helper thread in an engine call behind it (on GPU vLLM the refusal reached the
    sender before the reset came back, and two helper threads outlived the push)."""
    reset_ended = threading.Event()

    def refuse(weights, is_last):
        raise WeightRejected(
            "the engine refused 'w'", weight="w", shape=(4,), expected_shape=None, engine="rank 0", phase="load"
        )

    def reset() -> bool:  # an engine runs it after the receive returned: slower than the refusal's way back
        time.sleep(0.5)
        reset_ended.set()
        return True

    with BucketedWeightSender("push-reset", bucket_bytes=1 << 20, transport="shm", timeout_s=10) as sender:
        receiver = BucketedWeightReceiver(f"ipc://{sender.path}", "cpu", timeout_s=10)
        engine = EngineCall(
            what="a test engine's receive",
            call=lambda: receiver.receive(refuse),
            reports=lambda answer: [],
            rank_name=lambda rank: f"rank {rank}",
        )
        try:
            with HelperThreads("a one-shot push") as helpers, pytest.raises(WeightRejected, match="refused 'w'"):
                drive(
                    engine,
                    lambda on_hello: sender.send([("w", torch.ones(4))], on_hello=on_hello),
                    timeout_s=10,
                    version=1,
                    helpers=helpers,
                    then=reset,
                )
            assert reset_ended.is_set()
            assert [t.name for t in threading.enumerate() if t.name.startswith(HELPER_THREAD_PREFIX)] == []
        finally:
            receiver.close()
