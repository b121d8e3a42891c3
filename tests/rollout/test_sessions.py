"""What every engine's side of a push shares (``refitkit.rollout.sessions``): the driving side's helper threads for an
engine's blocking calls and the check of pushed weights against the engine's checkpoint."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import threading

import pytest
import torch
from torch import nn

from refitkit.errors import EngineTimeout, TransferError, UnknownWeight, WeightRejected, WeightShapeMismatch
from refitkit.rollout.load_plan import DirectLoads
from refitkit.rollout.sessions import SyncProgress, WeightCheck, bounded_call, land_in_place
from refitkit.transfer import BucketedWeightReceiver, BucketedWeightSender

pytestmark = pytest.mark.timeout(60)


def _caller_thread() -> int:
    return threading.get_ident()


def test_engine_calls_reuse_an_idle_helper_thread_and_never_one_whose_call_is_stuck():
    first = bounded_call(_caller_thread, timeout_s=5, what="a call", within="5 s")
    assert bounded_call(_caller_thread, timeout_s=5, what="a call", within="5 s") == first  # the warm thread again

    release, stuck_on = threading.Event(), []

    def stuck() -> None:
        stuck_on.append(threading.get_ident())
        release.wait(30)

    try:
        with pytest.raises(EngineTimeout, match=r"a stuck call did not return within 0\.2 s"):
            bounded_call(stuck, timeout_s=0.2, what="a stuck call", within="0.2 s")
        # the next calls run at once, never queued behind the stuck one
        later = {bounded_call(_caller_thread, timeout_s=5, what="a call", within="5 s") for _ in range(3)}
        assert stuck_on and stuck_on[0] not in later
    finally:
        release.set()


def _call_in_child(results: multiprocessing.Queue) -> None:
    results.put(bounded_call(lambda: "ran", timeout_s=5, what="a call in the child", within="5 s"))


def test_a_forked_child_gets_helper_threads_of_its_own():
    bounded_call(_caller_thread, timeout_s=5, what="a call", within="5 s")  # an idle pool in the parent
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_call_in_child, args=(results,))
    child.start()
    try:
        assert results.get(timeout=20) == "ran"  # the parent's pool has no threads in the child: it must not be used
    finally:
        child.join(20)
    assert child.exitcode == 0


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
