"""A transfer session creates no cyclic garbage on either side (the GC-free promise, audited)."""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from refitkit.transfer import BucketedWeightReceiver, BucketedWeightSender
from refitkit.watchdog import assert_no_cycles


@pytest.mark.timeout(60)
def test_a_session_leaves_no_reference_cycles_in_sender_or_receiver():
    endpoint = f"cyc{uuid.uuid4().hex[:8]}"
    weights = [(f"w{i}", torch.randn(257 + i, 3)) for i in range(40)] + [("big", torch.randn(64 * 1024))]
    received: dict[str, torch.Tensor] = {}
    go = threading.Event()
    finished = threading.Event()

    def receive_two_sessions() -> None:
        receiver = BucketedWeightReceiver(endpoint, "cpu", timeout_s=20.0)

        def load(batch, is_last):
            for name, tensor in batch:
                received[name] = tensor.clone()

        receiver.receive(load)  # warm-up session: imports, caches, lazily built tables
        go.wait(20.0)
        receiver.receive(load)
        finished.set()

    with BucketedWeightSender(endpoint, bucket_bytes=256 * 1024, transport="shm", timeout_s=20.0) as sender:
        peer = threading.Thread(target=receive_two_sessions, daemon=True)
        peer.start()
        sender.send(weights)
        received.clear()
        with assert_no_cycles("a shm transfer session (both sides)"):
            go.set()
            stats = sender.send(weights)
            assert finished.wait(20.0)
        peer.join(20.0)
    assert stats.tensors == len(weights) and stats.buckets >= 2
    assert all(torch.equal(received[name], tensor) for name, tensor in weights)
