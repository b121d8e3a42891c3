"""GPU only (marker ``cuda``): the 2 GiB bucket is given back to the device when send() returns, also when
the receiver was SIGKILLed while it had the bucket mapped; both processes run one CUDA allocator setting.

The measure is the device's free memory (``harness.device_free_bytes``): the bucket comes from
``cuMemAlloc``, which ``memory_reserved()`` cannot see. Each test runs its path once before it takes its
baseline (lazily loaded kernels, IPC state of both processes), so nothing depends on earlier tests.
The cuda_ipc round trips and fault cases run from test_roundtrip / test_fault_matrix (their
``cuda_ipc`` and ``shm-cuda`` parameters).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from refitkit.errors import TransferTimeout
from refitkit.transfer import BucketedWeightSender
from tests.transfer.harness import Case, assert_device_memory_back, device_free_bytes, receiver_killed_at, roundtrip
from tests.transfer.peers import ALLOC_CONF, cuda_allocator_expandable, digest

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(180)]

GIB = 1 << 30
CUDA_IPC = Case("cuda_ipc", "cuda", "cuda")


def weights_3gib() -> list[tuple[str, torch.Tensor]]:
    return [
        (f"layers.{i}.w", torch.full((128 << 20,), float(i), dtype=torch.bfloat16, device="cuda")) for i in range(12)
    ]


def sampling_free_memory(weights: list[tuple[str, torch.Tensor]], at_index: int, samples: list[int]) -> Iterator[Any]:
    """The weights as a generator that takes the device's free memory when item ``at_index`` is pulled
    (mid-stream: the bucket is allocated and buckets are in flight)."""
    for index, item in enumerate(weights):
        if index == at_index:
            samples.append(device_free_bytes())
        yield item


def test_two_gib_bucket_is_given_back_to_the_device(receiver_server, endpoint):
    weights = weights_3gib()
    expected = {name: digest(tensor) for name, tensor in weights}
    # The same stream once, so the baseline below already counts what a first session sets up for good.
    roundtrip(
        receiver_server,
        endpoint,
        weights,
        bucket_bytes=2 * GIB,
        case=CUDA_IPC,
        timeout_s=60,
        expected=expected,
        generator=True,
    )
    reserved_before, free_before = torch.cuda.memory_reserved(), device_free_bytes()
    during: list[int] = []
    stats, _ = roundtrip(
        receiver_server,
        endpoint,
        sampling_free_memory(weights, 6, during),
        bucket_bytes=2 * GIB,
        case=CUDA_IPC,
        timeout_s=60,
        expected=expected,
    )
    assert free_before - during[0] >= 2 * GIB  # the gauge sees the bucket while it is in use
    assert torch.cuda.memory_reserved() == reserved_before  # torch never held it (no limbo, no cache)
    assert_device_memory_back(free_before, "right after send() returned")
    assert stats.buckets >= 3


def test_sigkilled_receiver_does_not_strand_the_bucket(receiver_server, endpoint):
    weights = weights_3gib()
    roundtrip(receiver_server, endpoint, weights[:2], bucket_bytes=2 * GIB, case=CUDA_IPC, timeout_s=60)
    reserved_before, free_before = torch.cuda.memory_reserved(), device_free_bytes()  # before the victim exists
    with receiver_killed_at(endpoint, 2, device="cuda", timeout_s=5.0):
        with BucketedWeightSender(
            endpoint, bucket_bytes=2 * GIB, transport="cuda_ipc", timeout_s=5.0, direct=False
        ) as sender:
            began = time.monotonic()
            with pytest.raises(TransferTimeout):
                sender.send(weights)
            assert time.monotonic() - began < 5.0 + 2.0  # timeout_s, + the victim's hello and our cleanup (~0.02 s)
            assert torch.cuda.memory_reserved() == reserved_before  # nothing parked in a limbo
    # Our bucket is freed already; the dead receiver's context goes when the driver has torn it down.
    assert_device_memory_back(free_before, "after the receiver was SIGKILLed with the bucket mapped", settle_s=10.0)
    roundtrip(receiver_server, endpoint, weights[:2], bucket_bytes=2 * GIB, case=CUDA_IPC)


def test_the_bucket_is_made_while_the_hello_travels_and_freed_when_no_receiver_comes(endpoint):
    # transport='cuda_ipc' knows its device before any hello: the bucket is allocated and exported while the
    # receiver starts up (an engine's rpc takes milliseconds to reach its worker). A receiver that never
    # comes still leaves nothing allocated once send() has raised.
    weights = weights_3gib()[:2]

    def lonely_send(timeout_s: float, during: list[int]) -> None:
        with BucketedWeightSender(
            endpoint, bucket_bytes=2 * GIB, transport="cuda_ipc", timeout_s=timeout_s, direct=False
        ) as sender:
            sampler = threading.Timer(timeout_s / 2, lambda: during.append(device_free_bytes()))
            sampler.start()
            try:
                with pytest.raises(TransferTimeout, match="hello"):
                    sender.send(iter(weights))
            finally:
                sampler.join()

    lonely_send(0.2, [])  # once first: what a first export sets up for good is in the baseline
    free_before = device_free_bytes()
    during: list[int] = []
    lonely_send(1.0, during)
    assert free_before - during[0] >= 2 * GIB  # the bucket existed while the sender waited for a hello
    assert_device_memory_back(free_before, "after a send() that no receiver came to")


def test_receivers_run_with_the_senders_allocator_setting(receiver_server):
    """Run the transfer suite with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: it must hold in both processes."""
    conf = os.environ.get(ALLOC_CONF)
    wanted = "expandable_segments:true" in (conf or "").replace(" ", "").lower()
    assert receiver_server.info["alloc_conf"] == conf
    assert cuda_allocator_expandable() is wanted
    assert receiver_server.info["expandable"] is wanted


def test_binding_the_devices_context_for_a_mapping_leaves_the_queued_copies_running():
    """A direct session maps each new allocation of the sender as its bucket arrives, while the copies of the
    buckets before it still run on the receiver's stream: opening a mapping must not wait for them (a stream
    synchronize per allocation made an 8B sync into vLLM 28.8 ms instead of 18.5). A thread that has not used
    CUDA yet still gets the device's context made current, so the driver calls that follow work there."""
    from refitkit.transfer._ipc import cuda_ipc

    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 31)  # about a second of GPU time queued on the current stream
    began = time.perf_counter()
    cuda_ipc._bind_context(device)
    bound_s = time.perf_counter() - began
    still_running = not torch.cuda.current_stream(device).query()
    torch.cuda.synchronize()
    assert still_running and bound_s < 0.05, f"binding the context waited {bound_s * 1e3:.0f} ms for the stream"

    outcome: dict[str, Any] = {}

    def fresh_thread() -> None:  # no runtime call on this thread yet: the driver has no current context here
        try:
            cuda_ipc._bind_context(device)
            bucket = cuda_ipc.CudaIpcBucket(2 << 20, device=device)  # cuMemAlloc + cuIpcGetMemHandle need one
            bucket.free()
            outcome["ok"] = True
        except Exception as exc:  # reported below
            outcome["error"] = exc

    worker = threading.Thread(target=fresh_thread)
    worker.start()
    worker.join(60)
    assert outcome == {"ok": True}
