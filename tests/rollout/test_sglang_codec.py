"""Without SGLang: the JSON requests and replies that cross SGLang's update_weights_from_ipc, and SglangLink's checks."""

from __future__ import annotations

import json

import pytest

from refitkit.errors import EngineAsleep, EngineError, InvalidInput
from refitkit.rollout.links import SglangLink
from refitkit.rollout.sglang import (
    PROTOCOL, call_engine, decode_reply, decode_request, encode_reply, encode_request, handle_update, push_weights,
)  # fmt: skip
from refitkit.transfer import BucketedWeightSender


def test_a_receive_request_round_trips_as_plain_json():
    text = encode_request("receive", endpoint="ipc:///tmp/x", timeout_s=5.0, version=7)
    assert json.loads(text) == {"refitkit": PROTOCOL, "op": "receive", "endpoint": "ipc:///tmp/x", "timeout_s": 5.0, "version": 7}
    assert decode_request(text)["version"] == 7


@pytest.mark.parametrize(
    "text,message",
    [
        ("not json", "not JSON"),
        ('{"op": "receive"}', "without protocol"),
        ('{"refitkit": 1, "op": "exec"}', "op 'exec'"),
        ('{"refitkit": 1, "op": "discarded", "code": "x"}', r"unknown fields \['code'\]"),
        ('{"refitkit": 1, "op": "receive", "endpoint": 3, "timeout_s": 1, "version": null}', "endpoint=3"),
        ('{"refitkit": 1, "op": "receive", "endpoint": "e", "timeout_s": true, "version": null}', "timeout_s=True"),
        ('{"refitkit": 1, "op": "state", "fingerprints": [1]}', "list of parameter names"),
    ],
)
def test_a_malformed_request_is_refused_naming_what_is_wrong(text, message):
    with pytest.raises(InvalidInput, match=message):
        decode_request(text)


def test_replies_carry_results_and_the_schedulers_refusals_as_refitkit_errors():
    assert decode_reply(True, encode_reply(result={"version": 3}), what="receive") == {"version": 3}
    with pytest.raises(EngineAsleep, match="EngineAsleep: released"):
        decode_reply(False, encode_reply(error=EngineAsleep("released")), what="receive")
    with pytest.raises(EngineError, match="RuntimeError: boom"):
        decode_reply(False, encode_reply(error=RuntimeError("boom")), what="receive")


def test_an_answer_that_is_not_refitkits_says_the_plugin_is_missing():
    """SGLang's own checkpoint-engine path answers when the hook is not installed."""
    with pytest.raises(InvalidInput, match="without refitkit's plugin .* sglang.srt.plugins"):
        decode_reply(False, "IPC weight update failed: ImportError No module named 'checkpoint_engine'", what="state query")


def test_the_hook_hands_other_requests_to_sglang_and_answers_bad_ones_without_raising(monkeypatch):
    """An exception in a scheduler handler kills SGLang: a refitkit request that fails must come back as a reply."""
    from refitkit.rollout import _sglang_internals as internals

    class Request:
        def __init__(self, handles):
            self.zmq_handles = handles

    barriers = []
    monkeypatch.setattr(internals, "tp_barrier", lambda updater: barriers.append(updater))
    monkeypatch.setattr(internals, "update_output", lambda success, message: (success, message))
    original = lambda updater, req: ("sglang's own", req.zmq_handles)  # noqa: E731
    assert handle_update(original, "updater", Request({"GPU-1": "ipc:///ce"})) == ("sglang's own", {"GPU-1": "ipc:///ce"})
    assert barriers == []  # SGLang's own handler runs its own barrier

    success, message = handle_update(original, "updater", Request({"refitkit": '{"refitkit": 1, "op": "nope"}'}))
    assert success is False and json.loads(message)["error"] == "InvalidInput" and barriers == ["updater"]


def test_the_link_and_push_refuse_an_object_that_is_not_an_sglang_engine():
    with BucketedWeightSender("sglang-codec", transport="shm", timeout_s=5.0) as sender:
        with pytest.raises(InvalidInput, match="SglangLink: engine must be an sglang.Engine .* got a dict"):
            SglangLink({}, sender)
        with pytest.raises(InvalidInput, match="need an sglang.Engine .* got a str"):
            push_weights("engine", sender, [])
    with pytest.raises(InvalidInput, match="need an sglang.Engine"):
        call_engine(object(), encode_request("discarded"), what="x", timeout_s=1.0)


class FakeEngine:
    """Only the shape SglangLink checks (its calls are never made here)."""

    def __init__(self, **server_args):
        self.server_args = type("Args", (), {"tp_size": 1, "dp_size": 1, "enable_memory_saver": False, **server_args})()

    def update_weights_from_ipc(self, zmq_handles, flush_cache=True):
        raise AssertionError("not called in these tests")

    release_memory_occupation = resume_memory_occupation = update_weights_from_ipc


@pytest.mark.parametrize(
    "server_args,kwargs,message",
    [
        ({"tp_size": 2}, {}, "tp_size=2, dp_size=1; the link drives one scheduler"),
        ({}, {"release_memory": True}, "release_memory needs an engine made with enable_memory_saver=True"),
        ({}, {"release_memory": 1}, "release_memory=1; need a bool"),
        ({}, {"kv_headroom_bytes": -1}, "kv_headroom_bytes=-1"),
        ({}, {"engine_timeout_s": 0}, "engine_timeout_s"),
    ],
)
def test_the_link_refuses_settings_it_cannot_drive(server_args, kwargs, message):
    with BucketedWeightSender("sglang-codec", transport="shm", timeout_s=5.0) as sender:
        with pytest.raises(InvalidInput, match=message):
            SglangLink(FakeEngine(**server_args), sender, **kwargs)


def test_a_link_without_memory_release_does_not_drive_memory():
    with BucketedWeightSender("sglang-codec", transport="shm", timeout_s=5.0) as sender:
        link = SglangLink(FakeEngine(enable_memory_saver=True), sender, first_version=5)
        assert link.drives_memory is False and link.next_version == 5
        link.sleep_for_training()  # no-ops: nothing is called on the engine
        link.wake_for_sync()
        link.wake_for_rollout()
        assert SglangLink(FakeEngine(enable_memory_saver=True), sender, release_memory=True).drives_memory is True
