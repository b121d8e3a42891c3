"""The bridge from a receiver that calls back per bucket to the one iterator vLLM's loader takes: the session's
report (what ends the sender's send()) carries the loader's verdict on every weight."""

from __future__ import annotations

import threading

import pytest
import torch

from refitkit.errors import InvalidInput
from refitkit.rollout._stream_bridge import QUEUE_ITEMS, ReceiveBridge

pytestmark = pytest.mark.timeout(60)


def test_the_sessions_report_waits_for_the_loaders_verdict_on_the_last_weights():
    weights = [(f"w{i}", torch.full((4,), float(i))) for i in range(QUEUE_ITEMS + 24)]
    refused_at = len(weights) - 3  # past what the queue holds: the receiver has handed out the whole stream
    returned = threading.Event()
    raised: list[BaseException] = []

    def receive(on_bucket):  # as BroadcastWeightReceiver.receive: the buckets to the callback, then the report
        try:
            on_bucket(weights, True)
        except BaseException as exc:
            raised.append(exc)
            raise
        returned.set()  # the receiver would post "ok" to the sender now
        return "ok"

    bridge = ReceiveBridge(receive, timeout_s=10.0)
    taken = []
    refusal = InvalidInput(f"the loader refused w{refused_at}")
    for name, tensor in bridge:
        if len(taken) == refused_at:
            returned.wait(2.0)  # (bounded) give a receiver that reports early every chance to
            break
        taken.append((name, tensor))
    assert bridge.finish(refusal) is None  # the loader's own reason is not raised back at it
    assert not returned.is_set(), "the receiver reported the session ok before the loader had refused a weight"
    assert len(raised) == 1 and isinstance(raised[0], InvalidInput) and str(raised[0]) == str(refusal)
    assert [name for name, _ in taken] == [name for name, _ in weights[:refused_at]]
    assert all(torch.equal(tensor, weights[index][1]) for index, (_, tensor) in enumerate(taken))


def test_a_loader_that_takes_every_weight_lets_the_session_report_ok():
    weights = [(f"w{i}", torch.full((4,), float(i))) for i in range(QUEUE_ITEMS * 2)]
    bridge = ReceiveBridge(lambda on_bucket: on_bucket(weights, True) or "ok", timeout_s=10.0)
    got = [(name, tensor.clone()) for name, tensor in bridge]
    assert bridge.finish() == "ok" and [name for name, _ in got] == [name for name, _ in weights]
