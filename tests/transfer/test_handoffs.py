"""Bucket hand-offs: progress counters in shared memory, the frame fallback, and batched packing."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from refitkit.errors import ProtocolError, TransferError
from refitkit.transfer import BucketedWeightSender, doorbell, packing
from tests.transfer.harness import roundtrip
from tests.transfer.peers import one_shot_receiver_main
from tests.transfer.test_roundtrip import random_tensor

pytestmark = pytest.mark.timeout(60)


def counter_peer_main(path: str, conn) -> None:
    """Open the sender's segment, take three PACKED announcements (bounded), answer with two CONSUMED."""
    bell = doorbell.Doorbell.open(path)
    taken = sum(bell.take(doorbell.PACKED, timeout_s=20) for _ in range(3))
    extra = bell.take(doorbell.PACKED)  # nothing more was posted
    for _ in range(2):
        bell.post(doorbell.CONSUMED)
    conn.send((taken, extra))
    bell.close()


def test_semaphores_cross_processes():
    bell = doorbell.Doorbell.create(os.urandom(4).hex())
    try:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        peer = ctx.Process(target=counter_peer_main, args=(bell.path, child))
        peer.start()
        for _ in range(3):
            bell.post(doorbell.PACKED)
        assert parent.poll(30) and parent.recv() == (3, False)
        peer.join(10)
        assert [bell.take(doorbell.CONSUMED, timeout_s=5) for _ in range(3)] == [True, True, False]
    finally:
        bell.close()
    assert not os.path.exists(bell.path)


def test_timed_take_is_bounded():
    bell = doorbell.Doorbell.create(os.urandom(4).hex())
    try:
        began = time.monotonic()
        assert bell.take(doorbell.PACKED, timeout_s=0.2) is False
        assert 0.15 < time.monotonic() - began < 2.0
    finally:
        bell.close()


def test_open_refuses_foreign_paths_and_segments(tmp_path):
    with pytest.raises(ProtocolError, match="not a refitkit segment"):
        doorbell.Doorbell.open(str(tmp_path / "x"))
    with pytest.raises(ProtocolError, match="is not a path"):
        doorbell.Doorbell.open(12)
    impostor = f"/dev/shm/refitkit-{os.getuid()}-{os.getpid()}-{os.urandom(4).hex()}"
    with open(impostor, "wb") as handle:
        handle.write(b"\0" * doorbell.CONTROL_BYTES)
    try:
        with pytest.raises(ProtocolError, match="not a refitkit control segment"):
            doorbell.Doorbell.open(impostor)
    finally:
        os.unlink(impostor)


def mixed_stream(count: int = 120) -> list[tuple[str, torch.Tensor]]:
    dtypes = [torch.bfloat16, torch.float32, torch.int8, torch.float16]
    weights = [(f"w{i}", random_tensor((i % 9 + 1, 37), dtypes[i % 4], seed=i)) for i in range(count)]
    weights.insert(7, ("strided", random_tensor((40, 30), torch.float32, seed=99).t()))
    weights.insert(50, ("wide", random_tensor((3000,), torch.float32, seed=98)))  # 12000 bytes > a half of 8192
    weights.insert(90, ("split", random_tensor((9000,), torch.float32, seed=97)))  # 36000 bytes > the buffer
    return weights


def test_frame_fallback_round_trips(receiver_server, endpoint, monkeypatch, case):
    # Without shared semaphores the hand-offs travel as packed / done frames (CUDA: after events).
    monkeypatch.setattr(doorbell, "available", lambda: False)
    weights = [(name, tensor.to(case.tensor_device)) for name, tensor in mixed_stream()]
    stats, result = roundtrip(receiver_server, endpoint, weights, bucket_bytes=16 << 10, case=case)
    assert stats.buckets > 10 and result["calls"][-1][1] is True


def test_receiver_without_the_senders_shm_gets_frames(receiver_server, endpoint, monkeypatch, case):
    # A receiver in another container (same socket directory, its own /dev/shm) cannot open a
    # semaphore segment: the sender sees a different shm identity in the hello and uses frames.
    monkeypatch.setattr(doorbell, "shm_identity", lambda: [-1, -1])

    def no_segment(session):
        raise AssertionError("a control segment was made for a receiver that cannot open it")

    monkeypatch.setattr(doorbell.Doorbell, "create", staticmethod(no_segment))
    weights = [(name, tensor.to(case.tensor_device)) for name, tensor in mixed_stream()]
    stats, _ = roundtrip(receiver_server, endpoint, weights, bucket_bytes=16 << 10, case=case)
    assert stats.buckets > 10


def test_frame_fallback_reports_receiver_failure(receiver_server, endpoint, monkeypatch):
    monkeypatch.setattr(doorbell, "available", lambda: False)
    receiver_server.start_session(endpoint, timeout_s=10, mode="raise", arg=3)
    with BucketedWeightSender(endpoint, bucket_bytes=16 << 10, transport="shm", timeout_s=10) as sender:
        with pytest.raises(TransferError, match="loader exploded at bucket 3"):
            sender.send(mixed_stream())
    assert not receiver_server.result()["ok"]


@pytest.mark.parametrize("batch_max_bytes", [0, 256, 1 << 30], ids=["no-batching", "some-batched", "all-batched"])
def test_batched_and_single_copies_mix(receiver_server, endpoint, monkeypatch, batch_max_bytes, case):
    # Small contiguous tensors are copied in one batch per bucket and dtype, the rest one by one:
    # every split of the stream between the two paths must arrive bit-exact.
    monkeypatch.setattr(packing, "BATCH_MAX_BYTES", batch_max_bytes)
    weights = [(name, tensor.to(case.tensor_device)) for name, tensor in mixed_stream()]
    stats, _ = roundtrip(receiver_server, endpoint, weights, bucket_bytes=16 << 10, case=case)
    assert stats.tensors == 123


def test_hello_during_a_session_is_served_next(endpoint):
    # Two receivers ask at once: one is served now, the other's hello (read while the first session
    # runs) waits for the next send() instead of being turned away.
    ctx = mp.get_context("spawn")
    peers = []
    weights = [(f"w{i}", torch.full((2048,), float(i))) for i in range(400)]  # ~200 buckets: a long session
    with BucketedWeightSender(endpoint, bucket_bytes=16 << 10, transport="shm", timeout_s=20) as sender:
        for _ in range(2):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=one_shot_receiver_main, args=(endpoint, "cpu", 20, "collect", None, child))
            process.start()
            assert parent.poll(30) and parent.recv() == "starting"
            peers.append((process, parent))
        for _ in range(2):
            assert sender.send(weights).tensors == 400
    for process, parent in peers:
        assert parent.poll(30)
        result = parent.recv()
        process.join(10)
        assert len(result["digests"]) == 400, result
