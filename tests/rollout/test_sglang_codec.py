"""Without SGLang: the JSON requests and replies that cross SGLang's update_weights_from_ipc, SglangLink's checks, and
what a scheduler keeps between syncs (its receiver, in the one locked, pid-stamped registry)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time

import pytest
import torch

from refitkit.errors import EngineAsleep, EngineError, InvalidInput, LinkClosed, WeightShapeMismatch
from refitkit.rollout.links import SglangLink
from refitkit.rollout.sglang import (
    PROTOCOL,
    SchedulerReceiver,
    SchedulerReceivers,
    call_engine,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
    gather_replies,
    handle_update,
    merge_replies,
    push_weights,
    push_weights_broadcast,
    receive_from,
)
from refitkit.transfer import BroadcastWeightSender, BucketedWeightSender
from tests.helpers.ports import free_port
from tests.helpers.world import run_world


def test_a_receive_request_round_trips_as_plain_json():
    text = encode_request("receive", endpoint="ipc:///tmp/x", timeout_s=5.0, version=7)
    assert json.loads(text) == {
        "refitkit": PROTOCOL,
        "op": "receive",
        "endpoint": "ipc:///tmp/x",
        "timeout_s": 5.0,
        "version": 7,
    }
    assert decode_request(text)["version"] == 7


def test_a_close_request_has_no_fields():
    assert decode_request(encode_request("close")) == {"refitkit": PROTOCOL, "op": "close"}
    with pytest.raises(InvalidInput, match=r"unknown fields \['endpoint'\]"):
        decode_request(json.dumps({"refitkit": PROTOCOL, "op": "close", "endpoint": "ipc:///tmp/x"}))


@pytest.mark.parametrize(
    "text,message",
    [
        ("not json", "not JSON"),
        ('{"op": "receive"}', "without protocol"),
        ('{"refitkit": 2, "op": "exec"}', "op 'exec'"),
        ('{"refitkit": 2, "op": "discarded", "code": "x"}', r"unknown fields \['code'\]"),
        ('{"refitkit": 2, "op": "receive", "endpoint": 3, "timeout_s": 1, "version": null}', "endpoint=3"),
        ('{"refitkit": 2, "op": "receive", "endpoint": "e", "timeout_s": true, "version": null}', "timeout_s=True"),
        ('{"refitkit": 2, "op": "state", "fingerprints": [1]}', "list of parameter names"),
    ],
)
def test_a_malformed_request_is_refused_naming_what_is_wrong(text, message):
    with pytest.raises(InvalidInput, match=message):
        decode_request(text)


def test_replies_carry_results_and_the_schedulers_refusals_as_refitkit_errors():
    assert decode_reply(True, encode_reply(result={"version": 3}), what="receive") == {"version": 3}
    with pytest.raises(EngineAsleep) as asleep:
        decode_reply(False, encode_reply(error=EngineAsleep("released")), what="receive")
    assert str(asleep.value) == "SGLang's TP rank 0 in SGLang's receive raised EngineAsleep: released"
    with pytest.raises(EngineError) as other:
        decode_reply(False, encode_reply(error=RuntimeError("boom")), what="receive")
    assert type(other.value) is EngineError and str(other.value).endswith("raised RuntimeError: boom")
    assert other.value.__cause__.remote_type == "RuntimeError"  # the scheduler's own exception, as data


def test_a_schedulers_refusal_crosses_as_its_code_and_fields_not_as_text():
    """A refusal with fields (which weight, both shapes) comes back as its own type with every field, through the JSON
    SGLang carries; the reply names the type as a code, and its message is never read for it."""
    refused = WeightShapeMismatch(
        "SGLang scheduler (TP rank 0) refused weight 'w': shape [3, 2], checkpoint [2, 2]",
        weight="w",
        shape=(3, 2),
        expected_shape=(2, 2),
        engine="SGLang scheduler (TP rank 0)",
        phase="shape check",
    )
    reply = json.loads(encode_reply(error=refused, weights={"version": 1, "failed": None}))
    assert reply["failure"]["error_code"] == "WeightShapeMismatch" and reply["weights"]["version"] == 1
    reply["failure"]["error_message"] = "words that say EngineAsleep"  # the text says nothing about the type
    with pytest.raises(WeightShapeMismatch) as caught:
        decode_reply(False, json.dumps(reply), what="receive")
    rebuilt = caught.value
    assert (rebuilt.weight, rebuilt.shape, rebuilt.expected_shape, rebuilt.phase) == (
        "w",
        (3, 2),
        (2, 2),
        "shape check",
    )
    assert not isinstance(rebuilt, EngineAsleep)


def test_an_answer_that_is_not_refitkits_says_the_plugin_is_missing():
    """SGLang's own checkpoint-engine path answers when the hook is not installed."""
    with pytest.raises(InvalidInput, match="without refitkit's plugin .* sglang.srt.plugins"):
        decode_reply(
            False, "IPC weight update failed: ImportError No module named 'checkpoint_engine'", what="state query"
        )


def test_the_hook_hands_other_requests_to_sglang_and_answers_bad_ones_without_raising(monkeypatch):
    """An exception in a scheduler handler kills SGLang: a refitkit request that fails must come back as a reply."""
    from refitkit.rollout import _sglang_internals as internals

    class Request:
        def __init__(self, handles):
            self.zmq_handles = handles

    barriers = []
    monkeypatch.setattr(internals, "tp_barrier", lambda updater: barriers.append(updater))
    monkeypatch.setattr(internals, "tp_replies", lambda updater, reply, gather: [reply])  # one TP rank
    monkeypatch.setattr(internals, "update_output", lambda success, message: (success, message))
    original = lambda updater, req: ("sglang's own", req.zmq_handles)  # noqa: E731
    assert handle_update(original, "updater", Request({"GPU-1": "ipc:///ce"})) == (
        "sglang's own",
        {"GPU-1": "ipc:///ce"},
    )
    assert barriers == []  # SGLang's own handler runs its own barrier

    success, message = handle_update(original, "updater", Request({"refitkit": '{"refitkit": 2, "op": "nope"}'}))
    assert (
        success is False and json.loads(message)["failure"]["error_code"] == "InvalidInput" and barriers == ["updater"]
    )


def test_the_link_and_push_refuse_an_object_that_is_not_an_sglang_engine():
    with BucketedWeightSender("sglang-codec", transport="shm", timeout_s=5.0) as sender:
        with pytest.raises(InvalidInput, match="SglangLink: engine must be an sglang.Engine .* got a dict"):
            SglangLink({}, sender)
        with pytest.raises(InvalidInput, match="push_weights: engine must be an sglang.Engine .* got a str"):
            push_weights("engine", sender, [])
    with pytest.raises(InvalidInput, match="must be an sglang.Engine"):
        call_engine(object(), encode_request("discarded"), what="x", timeout_s=1.0)


class FakeEngine:
    """Only the shape SglangLink checks (its calls are never made here)."""

    def __init__(self, **server_args):
        defaults = {"tp_size": 1, "dp_size": 1, "enable_memory_saver": False, "enable_weights_cpu_backup": False}
        self.server_args = type("Args", (), {**defaults, **server_args})()

    def update_weights_from_ipc(self, zmq_handles, flush_cache=True):
        raise AssertionError("not called in these tests")

    release_memory_occupation = resume_memory_occupation = update_weights_from_ipc


@pytest.mark.parametrize(
    "server_args,kwargs,message",
    [
        (
            {"tp_size": 2},
            {},
            r"tp_size=2 with a BucketedWeightSender, which feeds one scheduler; give a BroadcastWeightSender\(receivers=2\)",
        ),
        ({"dp_size": 2}, {}, "dp_size=2, pp_size=1; refitkit feeds one data-parallel replica of one pipeline stage"),
        ({"pp_size": 2}, {}, "dp_size=1, pp_size=2; refitkit feeds one data-parallel replica of one pipeline stage"),
        ({}, {"sleep_level": 1}, "sleep_level needs an engine made with enable_memory_saver=True"),
        ({}, {"release_memory": True}, "sleep_level needs an engine made with enable_memory_saver=True"),
        ({"enable_memory_saver": True}, {"sleep_level": 3}, "sleep_level=3; need 1"),
        (
            {"enable_memory_saver": True},
            {"sleep_level": 1},
            r"sleep_level=1 but this engine discards .* pass sleep_level=2",
        ),
        (
            {"enable_memory_saver": True, "enable_weights_cpu_backup": True},
            {"sleep_level": 2},
            r"sleep_level=2 but this engine keeps .* \(enable_weights_cpu_backup=True\): pass sleep_level=1",
        ),
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
        assert SglangLink(FakeEngine(enable_memory_saver=True), sender, sleep_level=2).drives_memory is True


@pytest.mark.parametrize("backup,level", [(False, 2), (True, 1)])
def test_the_former_release_memory_still_works_for_a_release_and_says_sleep_level(backup, level):
    engine = FakeEngine(enable_memory_saver=True, enable_weights_cpu_backup=backup)
    with BucketedWeightSender("sglang-codec", transport="shm", timeout_s=5.0) as sender:
        with pytest.warns(DeprecationWarning, match=r"release_memory= is deprecated: use sleep_level="):
            link = SglangLink(engine, sender, release_memory=True)
        assert link.sleep_level == level and link.drives_memory is True
        with pytest.warns(DeprecationWarning, match="use sleep_level="):
            assert SglangLink(engine, sender, release_memory=False).drives_memory is False
        with (
            pytest.warns(DeprecationWarning),
            pytest.raises(InvalidInput, match="release_memory is sleep_level's former name"),
        ):
            SglangLink(engine, sender, release_memory=True, sleep_level=level)


def _gather_from_every_rank(rank: int, world_size: int) -> list[str]:
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")  # like SGLang's TP CPU group: not the default group
    reply = (
        encode_reply(result={"rank": rank, "note": "é" * (rank * 700 + 1)})
        if rank != 1
        else encode_reply(error=EngineAsleep("released"))
    )
    return gather_replies(group, reply)


def test_every_tp_ranks_reply_reaches_rank_0_in_rank_order_over_gloo():
    """Replies of different lengths (multi-byte UTF-8) as uint8 tensors over a real gloo group: no pickle."""
    gathered = run_world(_gather_from_every_rank, 3, timeout_s=120)
    assert gathered[0] == gathered[1] == gathered[2]
    replies = [json.loads(text) for text in gathered[0]]
    assert [reply.get("result", {}).get("rank") for reply in replies] == [0, None, 2]
    assert replies[2]["result"]["note"] == "é" * 1401 and replies[1]["failure"]["error_code"] == "EngineAsleep"


def test_tp_replies_merge_into_one_answer_naming_every_failed_rank():
    ok = [encode_reply(result={"version": 4, "complete": True, "rank": rank}) for rank in range(3)]
    success, merged = merge_replies(ok)
    result = decode_reply(success, merged, what="receive")
    assert result["rank"] == 0 and [ranks["rank"] for ranks in result["tp_ranks"]] == [0, 1, 2]

    failed = [ok[0], encode_reply(error=EngineAsleep("weights released")), encode_reply(error=RuntimeError("boom"))]
    success, merged = merge_replies(failed)
    assert success is False
    with pytest.raises(
        EngineAsleep,
        match="TP rank 1 in SGLang's receive raised EngineAsleep: weights released; SGLang's TP rank 2: RuntimeError: boom",
    ):
        decode_reply(success, merged, what="receive")
    assert merge_replies(ok[:1]) == (True, ok[0])  # one TP rank: its reply as it is


def test_a_tensor_parallel_engine_takes_the_broadcast_with_one_receiver_per_tp_rank():
    secret = "sglang-codec-secret-0123456789"
    with BucketedWeightSender("sglang-codec", transport="shm", timeout_s=5.0) as sender:
        with pytest.raises(
            InvalidInput,
            match=r"tp_size=2 schedulers and a BucketedWeightSender feeds one; use push_weights_broadcast .*receivers=2",
        ):
            push_weights(FakeEngine(tp_size=2), sender, [])
    with pytest.raises(
        InvalidInput,
        match=r"receive_from: this SGLang engine runs tp_size=2 schedulers .* put '\{rank\}' in the endpoint",
    ):
        receive_from(FakeEngine(tp_size=2), "ipc:///tmp/one-sender")
    with pytest.raises(
        InvalidInput,
        match=r"receive_from: dp_size=1, pp_size=2; refitkit feeds one data-parallel replica of one pipeline stage",
    ):
        receive_from(FakeEngine(pp_size=2), "ipc:///tmp/one-sender")
    with BroadcastWeightSender(("127.0.0.1", free_port()), secret=secret, receivers=2, timeout_s=5.0) as sender:
        message = (
            r"2 scheduler\(s\) join the broadcast as rank\(s\) 2..3 but the sender expects receivers=2 \(ranks 1..2\)"
        )
        with pytest.raises(InvalidInput, match="push_weights_broadcast: this SGLang engine's " + message):
            push_weights_broadcast(FakeEngine(tp_size=2), sender, [], secret=secret, version=1, first_rank=2)
        with pytest.raises(InvalidInput, match="SglangLink: this SGLang engine's " + message):
            SglangLink(FakeEngine(tp_size=2), sender, secret=secret, first_rank=2)
        link = SglangLink(FakeEngine(tp_size=2), sender, secret=secret)  # ranks 1 and 2
        assert link.broadcast and link.next_version == 0
    with BroadcastWeightSender(("127.0.0.1", free_port()), secret=secret, receivers=3, timeout_s=5.0) as sender:
        assert (
            SglangLink(FakeEngine(), sender, secret=secret, first_rank=3).first_rank == 3
        )  # ranks 1-2: other receivers


def _hook_on_a_tp_group(rank: int, world_size: int) -> tuple[bool, str]:
    """``handle_update`` on every rank of a real gloo TP group; only SGLang's own objects are stand-ins (the updater's
    attributes the hook reads, and the output type)."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from refitkit.rollout import _sglang_internals as internals

    internals.update_output = lambda success, message: (success, message)  # SGLang's output class: not on CPU
    updater = SimpleNamespace(
        tp_worker=SimpleNamespace(model_runner=SimpleNamespace(ps=SimpleNamespace(tp_rank=rank, tp_size=world_size))),
        tp_cpu_group=dist.new_group(backend="gloo"),
    )
    texts = ['{"refitkit": 2, "op": "nope"}', "not json", '{"refitkit": 2, "op": "discarded", "code": "x"}']
    request = SimpleNamespace(zmq_handles={"refitkit": texts[rank]})
    return handle_update(lambda updater, req: None, updater, request)


def test_the_hook_answers_for_every_tp_rank_through_rank_0():
    outcomes = run_world(_hook_on_a_tp_group, 3, timeout_s=120)
    assert len({message for _, message in outcomes}) == 1  # every rank merged the same answer
    success, message = outcomes[0]
    assert success is False
    with pytest.raises(
        InvalidInput,
        match=r"TP rank 0 in SGLang's receive raised InvalidInput: refitkit request op 'nope'.*; SGLang's TP rank 1: InvalidInput: refitkit request is not JSON.*; SGLang's TP rank 2: InvalidInput: .*unknown fields \['code'\]",
    ):
        decode_reply(success, message, what="receive")


def test_a_closed_sglang_link_refuses_to_send_naming_itself():
    with BucketedWeightSender("sglang-codec", transport="shm", timeout_s=5.0) as sender:
        with SglangLink(FakeEngine(), sender) as link:
            pass
        link.close()  # twice is fine
        with pytest.raises(
            LinkClosed, match=r"^SglangLink is closed: its helper threads are gone; make a new SglangLink"
        ):
            link.send([("w", torch.zeros(2))])  # refused before the engine is asked anything
        assert link.next_version == 0


class Linear(torch.nn.Module):
    """Loads by attribute name, as a scheduler's model does."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 4))
        self.bias = torch.nn.Parameter(torch.zeros(4))

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            getattr(self, name).data.copy_(tensor)


def test_a_scheduler_keeps_one_receiver_for_its_endpoint_across_syncs(tmp_path):
    model = Linear()
    scheduler = SchedulerReceiver(
        model=model, device=torch.device("cpu"), rank=0, checkpoint=(str(tmp_path), None, False)
    )
    kept = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        for version, endpoint in [(1, "sglang-keep"), (2, "sglang-keep"), (3, "sglang-keep-other")]:
            weights = [("weight", torch.full((4, 4), float(version))), ("bias", torch.arange(4.0) + version)]
            with BucketedWeightSender(endpoint, bucket_bytes=1 << 16, transport="shm", timeout_s=10.0) as sender:
                landing = pool.submit(scheduler.receive, f"ipc://{sender.path}", 10.0, version, weights_released=False)
                sender.send(weights)
                assert landing.result(timeout=10.0)["version"] == version
            assert torch.equal(model.weight, weights[0][1]) and torch.equal(model.bias, weights[1][1])
            kept.append(scheduler._receiver)
    assert kept[0] is kept[1]  # the same endpoint: the same receiver, not one per sync
    assert kept[2] is not kept[1] and kept[2].endpoint.endswith("/sglang-keep-other.sock")  # replaced
    scheduler.close()
    assert scheduler._receiver is None
    assert scheduler.weights.version.version == 3


def test_the_registry_makes_one_receiver_per_model_under_its_lock_and_a_forked_child_sees_none():
    registry, model, made = SchedulerReceivers(), Linear(), []

    def make() -> object:
        made.append(threading.get_ident())
        time.sleep(0.05)  # a slow make: threads arriving meanwhile must get this one, not make their own
        return object()

    start = threading.Barrier(4)

    def get() -> object:
        start.wait(5)
        return registry.get_or_make(model, make)

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        got = [future.result(timeout=10) for future in [pool.submit(get) for _ in range(4)]]
    assert len(made) == 1 and all(receiver is got[0] for receiver in got)
    assert registry.get(model) is got[0] and registry.get(Linear()) is None

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's entry (its connections and mappings) is not its own
        said = f"{registry.get(model) is None} {registry.get_or_make(model, lambda: 'fresh')}"
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read().decode()
    os.waitpid(pid, 0)
    assert said == "True fresh"
    assert registry.get(model) is got[0]  # the parent's entry stands
