"""What every engine's side of a push shares (``refitkit.rollout.sessions``): the driving side's helper threads for an
engine's blocking calls (owned by their caller, gone once it is closed, never used across a fork) and the check of
pushed weights against the engine's checkpoint."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time

import pytest
import torch
from torch import nn

from refitkit.errors import (
    EngineError,
    EngineTimeout,
    LinkClosed,
    TransferError,
    UnknownWeight,
    WeightRejected,
    WeightShapeMismatch,
)
from refitkit.rollout.load_plan import DirectLoads
from refitkit.rollout.sessions import (
    HELPER_THREAD_PREFIX,
    HelperThreads,
    SyncProgress,
    WeightCheck,
    bounded_call,
    land_in_place,
)
from refitkit.transfer import BucketedWeightReceiver, BucketedWeightSender

pytestmark = pytest.mark.timeout(60)


def _caller_thread() -> int:
    return threading.get_ident()


def helper_threads_alive() -> list[str]:
    """The names of refitkit's helper threads alive in this process."""
    return [thread.name for thread in threading.enumerate() if thread.name.startswith(HELPER_THREAD_PREFIX)]


def test_a_one_shot_engine_call_leaves_no_helper_thread_alive():
    assert bounded_call(_caller_thread, timeout_s=5, what="a call", within="5 s") != threading.get_ident()
    assert helper_threads_alive() == []
    with pytest.raises(EngineError, match=r"a failing call failed: ZeroDivisionError: division by zero"):
        bounded_call(lambda: 1 / 0, timeout_s=5, what="a failing call", within="5 s")
    assert helper_threads_alive() == []


def test_an_owners_helper_threads_are_reused_never_one_whose_call_is_stuck_and_closing_waits_for_none(caplog):
    release, stuck_on = threading.Event(), []

    def stuck() -> None:
        stuck_on.append(threading.current_thread())
        release.wait(30)

    helpers = HelperThreads("a link")
    try:
        first = bounded_call(_caller_thread, timeout_s=5, what="a call", within="5 s", helpers=helpers)
        assert bounded_call(_caller_thread, timeout_s=5, what="a call", within="5 s", helpers=helpers) == first
        assert len(helper_threads_alive()) == 1  # kept between calls while the owner lives

        with pytest.raises(EngineTimeout, match=r"a stuck call did not return within 0\.2 s"):
            bounded_call(stuck, timeout_s=0.2, what="a stuck call", within="0.2 s", helpers=helpers)
        # the next calls run at once on fresh threads, never queued behind the stuck one
        later = {
            bounded_call(_caller_thread, timeout_s=5, what="a call", within="5 s", helpers=helpers) for _ in range(3)
        }
        assert stuck_on and stuck_on[0].ident not in later and first not in later

        began = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="refitkit.rollout.sessions"):
            helpers.close()
        assert time.monotonic() - began < 2.0  # the stuck thread was reported, not waited for
        assert helper_threads_alive() == [stuck_on[0].name]
        assert (
            f"a link closed with helper threads still running engine calls its callers gave up on: {stuck_on[0].name}"
            in caplog.text
        )
    finally:
        release.set()
        helpers.close()  # (twice is fine)
    stuck_on[0].join(5)
    assert helper_threads_alive() == []


def test_closed_helper_threads_refuse_calls_naming_their_owner():
    helpers = HelperThreads("VllmLink")
    bounded_call(_caller_thread, timeout_s=5, what="a call", within="5 s", helpers=helpers)
    helpers.close()
    helpers.close()
    assert helper_threads_alive() == []
    with pytest.raises(LinkClosed, match=r"^VllmLink is closed: its helper threads are gone; make a new VllmLink"):
        bounded_call(_caller_thread, timeout_s=5, what="a call", within="5 s", helpers=helpers)


def test_a_forked_child_is_refused_the_parents_helper_threads():
    with HelperThreads("SglangLink") as helpers:
        bounded_call(_caller_thread, timeout_s=5, what="a call", within="5 s", helpers=helpers)  # threads in the parent
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its copy of the pool has no threads behind it
            try:
                bounded_call(lambda: "ran", timeout_s=5, what="a call in the child", within="5 s", helpers=helpers)
                said = "ran on the parent's helper threads"
            except BaseException as exc:
                said = f"{type(exc).__name__}: {exc}"
            helpers.close()  # drops the parent's threads, touches nothing
            os.write(write, said.encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            said = pipe.read().decode()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert said == (
            f"LinkClosed: SglangLink was made in process {os.getpid()} and is used in process {pid} (a forked child): "
            "its helper threads exist only in the process that made it; make a new SglangLink in this process"
        )
        assert bounded_call(lambda: "ran", timeout_s=5, what="a call", within="5 s", helpers=helpers) == "ran"
    assert helper_threads_alive() == []


class TwoParams(nn.Module):
    """Loads by attribute name, as an engine's loader does: an unknown name raises inside the loader."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(4, 4))
        self.b = nn.Parameter(torch.zeros(8))

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            getattr(self, name).data.copy_(tensor)


def _land(weights: list, check: WeightCheck) -> tuple[SyncProgress, str, str]:
    """One real session (shm) landed in place through ``check`` in a helper thread; the two sides' errors."""
    model, progress = TwoParams(), SyncProgress()
    with BucketedWeightSender("sessions-check", bucket_bytes=1 << 16, transport="shm", timeout_s=10.0) as sender:
        receiver = BucketedWeightReceiver("sessions-check", "cpu", timeout_s=10.0)
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            direct = DirectLoads(model, model.load_weights)
            landing = pool.submit(land_in_place, receiver.receive, direct, progress, check)
            with pytest.raises(TransferError) as sent:
                sender.send(weights)
            with pytest.raises(TransferError) as received:
                landing.result(timeout=10.0)
    return progress, str(sent.value), str(received.value)


def test_a_weight_unlike_the_checkpoints_is_refused_before_the_loader_sees_it():
    check = WeightCheck({"a": (4, 4), "b": (8,)}, "engine rank 3")
    progress, sent, _ = _land([("a", torch.ones(4, 4)), ("b", torch.ones(9))], check)

    refused = check.rejection(progress, phase="landing")
    assert isinstance(refused, WeightShapeMismatch) and refused is progress.refusal
    assert str(refused).startswith(
        "engine rank 3 refused weight 'b': pushed with shape [9], but the checkpoint it loaded has [8] (phase: shape "
        "check, before loading it). The weights before it were loaded"
    )
    assert (refused.weight, refused.shape, refused.expected_shape, refused.engine) == ("b", (9,), (8,), "engine rank 3")
    assert sent.endswith(f"on_bucket raised WeightShapeMismatch: {refused}")  # the bucket released cleanly
    assert progress.names == set()  # nothing of that bucket reached the loader


def test_a_loaders_refusal_names_the_weight_and_keeps_no_bucket_view():
    check = WeightCheck({"a": (4, 4), "b": (8,)}, "engine rank 0")
    progress, sent, received = _land([("a", torch.ones(4, 4)), ("zz", torch.ones(3))], check)

    # the loader's frames held the bucket's views: kept with them, the release would fail ("still referenced")
    assert sent.endswith("on_bucket raised AttributeError: 'TwoParams' object has no attribute 'zz'"), sent
    assert isinstance(progress.refusal, AttributeError)
    refused = check.rejection(progress, phase="landing")
    assert isinstance(refused, UnknownWeight)
    assert str(refused).startswith(
        "engine rank 0 has no parameter for pushed weight 'zz' (shape [3]; the checkpoint it loaded has no such name): "
        "its loader raised AttributeError: 'TwoParams' object has no attribute 'zz' (phase: landing)"
    )
    assert refused.remote_type == "AttributeError"
    assert refused.remote_message == "'TwoParams' object has no attribute 'zz'"
    unchecked = WeightCheck(None, "engine rank 0").rejection(progress, phase="landing")  # no checkpoint to tell by
    assert type(unchecked) is WeightRejected and unchecked.weight == "a, zz" and unchecked.shape is None
    assert str(unchecked).startswith(
        "engine rank 0's loader refused one of the weights ['a', 'zz'] (the checkpoint's shapes are unknown): "
        "AttributeError"
    )
