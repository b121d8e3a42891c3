"""GPU only (marker ``cuda``): the 2 GiB bucket is gone from the sender after send() returns,
also when the receiver was SIGKILLed while it had the bucket mapped.

The cuda_ipc round trips and fault cases run from test_roundtrip / test_fault_matrix (their
``cuda_ipc`` and ``shm-cuda`` parameters).
"""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from refitkit.errors import TransferTimeout
from refitkit.transfer import BucketedWeightSender
from tests.transfer.harness import Case, roundtrip
from tests.transfer.peers import one_shot_receiver_main

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(180)]

GIB = 1 << 30
SLACK_BYTES = 64 << 20  # device free memory moves by a few MiB with nothing of ours allocated


def weights_3gib() -> list[tuple[str, torch.Tensor]]:
    return [(f"layers.{i}.w", torch.full((128 << 20,), float(i), dtype=torch.bfloat16, device="cuda")) for i in range(12)]


def device_free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_two_gib_bucket_leaves_nothing_reserved(receiver_server, endpoint):
    case = Case("cuda_ipc", "cuda", "cuda")
    roundtrip(receiver_server, endpoint + "w", [("warm", torch.ones(8, device="cuda"))], case=case)  # receiver CUDA up
    weights = weights_3gib()
    reserved_before, free_before = torch.cuda.memory_reserved(), device_free_bytes()
    stats, _ = roundtrip(receiver_server, endpoint, weights, bucket_bytes=2 * GIB, case=case, timeout_s=60)
    assert torch.cuda.memory_reserved() == reserved_before  # right after send() returned
    assert device_free_bytes() >= free_before - SLACK_BYTES  # the driver got the 2 GiB back too
    assert stats.buckets >= 3


def test_sigkilled_receiver_does_not_strand_the_bucket(receiver_server, endpoint):
    weights = weights_3gib()
    reserved_before, free_before = torch.cuda.memory_reserved(), device_free_bytes()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    victim = ctx.Process(target=one_shot_receiver_main, args=(endpoint, "cuda", 5.0, "kill", 2, child))
    victim.start()
    assert parent.poll(60) and parent.recv() == "starting"
    with BucketedWeightSender(endpoint, bucket_bytes=2 * GIB, transport="cuda_ipc", timeout_s=5.0) as sender:
        began = time.monotonic()
        with pytest.raises(TransferTimeout):
            sender.send(weights)
        assert time.monotonic() - began < 5.0 + 1.0 + 2.0  # + the victim's CUDA start before its hello
        assert torch.cuda.memory_reserved() == reserved_before  # nothing parked in a limbo
    victim.join(30)
    assert victim.exitcode == -9
    # The dead receiver's context is torn down by the driver; our bucket was freed by us already.
    deadline = time.monotonic() + 10
    while device_free_bytes() < free_before - SLACK_BYTES and time.monotonic() < deadline:
        time.sleep(0.1)  # waiting on the driver's teardown of the killed process, not on our code
    assert device_free_bytes() >= free_before - SLACK_BYTES
    roundtrip(receiver_server, endpoint, weights[:2], bucket_bytes=2 * GIB, case=Case("cuda_ipc", "cuda", "cuda"))
