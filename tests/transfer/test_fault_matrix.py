"""Fault matrix: every failure ends in the right exception within timeout_s + 1 s (a dead peer: within a second,
told by its connection), memory is released on both sides, and a fresh session on the same endpoint then succeeds.

With CUDA tensors (the ``cuda_ipc`` and ``shm-cuda`` cases, GPU only) "released" is measured on the
device: its free memory, taken in the test after one good session on the same path, drops by at least a
page while the receiver holds the bucket (the sender's driver-allocated bucket, or the receiver's staging
copy) and is back to that baseline after the failure.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
import traceback

import msgpack
import pytest
import torch
import zmq

from refitkit.errors import PeerGone, ProtocolError, RefitError, RemoteError, TransferError, TransferTimeout
from refitkit.transfer import BucketedWeightReceiver, BucketedWeightSender
from refitkit.transfer._ipc.endpoint import socket_path
from refitkit.transfer.protocol import WIRE_VERSION
from tests.helpers import procs
from tests.transfer.harness import (
    PAGE_BYTES,
    assert_device_memory_back,
    device_free_bytes,
    own_segment_files,
    receiver_killed_at,
    roundtrip,
)
from tests.transfer.peers import killed_sender_main, mapped_segments

pytestmark = pytest.mark.timeout(60)

TIMEOUT_S = 3.0
BUCKET = 8192  # halves of 4096 bytes: one 4000-byte tensor per bucket


def stream(count: int = 6, device: str = "cpu"):
    return [(f"w{i}", torch.full((1000,), float(i), device=device)) for i in range(count)]


def fresh_session_works(server, endpoint, case=None):
    kwargs = {"case": case} if case is not None else {}
    roundtrip(server, endpoint, stream(3, case.tensor_device if case else "cpu"), bucket_bytes=BUCKET, **kwargs)


def prepared(server, endpoint: str, case) -> tuple[list, int | None]:
    """The case's weights and, with CUDA tensors, the device's free memory once both processes have run
    this path once (kernels load lazily and IPC sets up on first use: not a leak of the failure's)."""
    weights = stream(device=case.tensor_device)
    if case.tensor_device != "cuda":
        return weights, None
    fresh_session_works(server, endpoint, case)
    return weights, device_free_bytes()


def device_memory_given_back(result: dict, baseline_free: int | None, case) -> None:
    """The bucket was on the device while the receiver held it, and nothing of it is left after the failure."""
    if baseline_free is None:
        return
    assert baseline_free - result["device_free_in_on_bucket"] >= PAGE_BYTES, "the bucket never showed on the device"
    assert_device_memory_back(baseline_free, f"{case}: after the failed session")


def send_expecting(endpoint, error, match, *, weights=None, transport="shm", within_s=TIMEOUT_S + 1.0):
    """Run send() through the bucket (``direct=False``: these faults are the bucket path's; test_direct.py has the
    direct path's) and check it fails with ``error`` within ``within_s`` (timeout + 1 s), holding no bucket memory."""
    with BucketedWeightSender(
        endpoint, bucket_bytes=BUCKET, transport=transport, timeout_s=TIMEOUT_S, direct=False
    ) as sender:
        began = time.monotonic()
        with pytest.raises(error, match=match) as raised:
            sender.send(weights if weights is not None else stream())
        assert time.monotonic() - began < within_s
        assert own_segment_files() == [] and mapped_segments() == []
    return raised.value


def test_receiver_raises_in_on_bucket(receiver_server, endpoint, case):
    weights, baseline_free = prepared(receiver_server, endpoint, case)
    receiver_server.start_session(endpoint, device=case.receiver_device, timeout_s=TIMEOUT_S, mode="raise", arg=2)
    error = send_expecting(
        endpoint, TransferError, "loader exploded at bucket 2", transport=case.transport, weights=weights
    )
    assert type(error) is TransferError and "loader exploded at bucket 2" in error.remote_message
    result = receiver_server.result()
    assert not result["ok"] and result["type"] == "TransferError" and result["segments_after"] == []
    device_memory_given_back(result, baseline_free, case)
    fresh_session_works(receiver_server, endpoint, case)


def test_a_loaders_exception_reaches_the_sender_with_its_type_and_frames(receiver_server, endpoint):
    """The loader's exception travels as data (type, message, its last frames as text) and is the sender's error's
    cause; on the receiver, the raised TransferError chains the loader's own exception."""
    receiver_server.start_session(endpoint, timeout_s=TIMEOUT_S, mode="raise", arg=2)
    error = send_expecting(endpoint, TransferError, "on_bucket raised RuntimeError: loader exploded at bucket 2")
    assert type(error) is TransferError and error.remote_type == "RuntimeError"
    assert error.remote_message == "on_bucket raised RuntimeError: loader exploded at bucket 2"
    frames = error.remote_traceback
    assert "tests/transfer/peers.py" in frames and "in on_bucket" in frames, frames
    assert 'raise RuntimeError(f"loader exploded at bucket {arg}")' in frames
    assert frames.rstrip().endswith("RuntimeError: loader exploded at bucket 2")
    cause = error.__cause__
    assert type(cause) is RemoteError and isinstance(cause, RefitError)
    assert (cause.remote_type, cause.remote_message) == ("RuntimeError", "loader exploded at bucket 2")
    assert cause.remote_traceback == frames and str(cause).startswith("RuntimeError: loader exploded at bucket 2\n")
    shown = "".join(traceback.format_exception(error))
    assert "The above exception was the direct cause of the following exception" in shown and "in on_bucket" in shown
    result = receiver_server.result()
    assert not result["ok"] and result["type"] == "TransferError" and result["segments_after"] == []
    assert result["cause"] == ("RuntimeError", "loader exploded at bucket 2")  # raise ... from the loader's exception
    assert re.search(r"failed \(streaming; \d+ buckets sent\): on_bucket raised", str(error))
    fresh_session_works(receiver_server, endpoint)


def test_receiver_raises_in_cleanup(receiver_server, endpoint, case):
    # The loader keeps a view past its call: release must refuse (not unmap under it) and report.
    weights, baseline_free = prepared(receiver_server, endpoint, case)
    receiver_server.start_session(endpoint, device=case.receiver_device, timeout_s=TIMEOUT_S, mode="keep_view")
    error = send_expecting(endpoint, TransferError, "still referenced", transport=case.transport, weights=weights)
    assert "valid only until the next one" in error.remote_message
    # the phase it failed in, not the state its release left
    assert re.search(r"failed \(draining; \d+ buckets sent\): receiver release: ", str(error)), error
    result = receiver_server.result()
    assert not result["ok"] and "still referenced" in result["message"]
    assert result["segments_after"] == []  # the kept views died with the session: the mapping went with them
    device_memory_given_back(result, baseline_free, case)
    fresh_session_works(receiver_server, endpoint, case)


def test_receiver_sigkilled_mid_stream(receiver_server, endpoint, case):
    weights, baseline_free = prepared(receiver_server, endpoint, case)  # before the victim's CUDA context exists
    with receiver_killed_at(endpoint, 2, device=case.receiver_device, timeout_s=TIMEOUT_S):  # its hello is queued first
        # Its connection's end ends the sender's wait (or, frames being sent ahead of the copies, a send to the
        # vanished peer is refused at once): within a second, not timeout_s.
        send_expecting(
            endpoint,
            PeerGone,
            r"the receiver on .* is gone .*bucket \d+",
            transport=case.transport,
            weights=weights,
            within_s=1.5,
        )
    if baseline_free is not None:  # our bucket is freed; the victim's memory once the driver tore its context down
        assert_device_memory_back(baseline_free, f"{case}: after the receiver was SIGKILLed mid-stream", settle_s=10.0)
    fresh_session_works(receiver_server, endpoint, case)


def test_sender_sigkilled_mid_stream(receiver_server, endpoint):
    ctx = procs.context()
    parent, child = ctx.Pipe()
    victim = ctx.Process(target=killed_sender_main, args=(endpoint, BUCKET, 3, child))
    victim.start()
    assert parent.poll(30)
    victim_pid = parent.recv()
    receiver = BucketedWeightReceiver(endpoint, "cpu", timeout_s=TIMEOUT_S)
    seen: list[bool] = []
    began = time.monotonic()
    with pytest.raises(PeerGone, match=r"streaming: the sender on .* is gone .* waiting for bucket \d+ .*INCOMPLETE"):
        receiver.receive(lambda weights, is_last: seen.append(is_last))
    assert time.monotonic() - began < 1.5  # told by its connection, not by timeout_s
    victim.join(10)
    assert victim.exitcode == -9 and seen and not any(seen)
    assert mapped_segments() == []
    assert not any(f"-{victim_pid}-" in name for name in os.listdir("/dev/shm"))  # unlinked once mapped
    assert os.path.exists(socket_path(endpoint))  # the dead sender's socket file is still there...
    fresh_session_works(receiver_server, endpoint)  # ...and a new sender binds over it


def test_nobody_listening(endpoint):
    error = send_expecting(endpoint, TransferTimeout, "handshake: no hello")
    assert "timeout_s=3" in str(error)


def test_no_sender(endpoint):
    receiver = BucketedWeightReceiver(endpoint, "cpu", timeout_s=TIMEOUT_S)
    began = time.monotonic()
    with pytest.raises(TransferTimeout, match="handshake: no setup from the sender .* timeout_s=3"):
        receiver.receive(lambda weights, is_last: None)
    assert time.monotonic() - began < TIMEOUT_S + 1.0


def test_stale_socket_file(receiver_server, endpoint):
    leftover = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    leftover.bind(socket_path(endpoint))
    leftover.close()
    fresh_session_works(receiver_server, endpoint)


@pytest.mark.parametrize(
    "payload, match",
    [
        ([b"\x93garbage!"], "undecodable|not a map"),
        ([msgpack.packb({"v": 0, "kind": "hello"})], "wire version 0"),
        ([msgpack.packb({"v": WIRE_VERSION, "kind": "load_pickle"})], "unknown frame kind"),
        ([b"two", b"parts"], "2-part message"),
    ],
    ids=["garbage", "old-version", "unknown-kind", "multipart"],
)
def test_garbage_to_the_sender(receiver_server, endpoint, payload, match):
    """Frames that are not a receiver's, from any process of our uid, are dropped and logged while the sender waits
    for a hello; the session then serves the real receiver. Before: the first of them was a ProtocolError that failed
    send()."""
    # Closed in a finally: a context left open in a failed test's traceback hangs the run when GC'd.
    context = zmq.Context()
    rogue = context.socket(zmq.DEALER)
    dropped = DroppedFrames()
    try:
        with BucketedWeightSender(endpoint, bucket_bytes=BUCKET, timeout_s=TIMEOUT_S) as sender:
            outcome: list = []
            waiting = threading.Thread(target=lambda: outcome.append(sender.send(stream())))
            waiting.start()  # no receiver yet: the sender reads the rogue's frame alone
            rogue.setsockopt(zmq.LINGER, 0)
            rogue.connect(f"ipc://{sender.path}")
            rogue.send_multipart(payload)
            assert dropped.seen.wait(TIMEOUT_S), "the sender logged no dropped frame"
            receiver_server.start_session(endpoint, timeout_s=TIMEOUT_S)
            waiting.join(TIMEOUT_S + 1)
            assert outcome and outcome[0].tensors == 6 and receiver_server.result()["ok"], outcome
            assert own_segment_files() == []
    finally:
        dropped.close()
        rogue.close()
        context.term()
    assert re.search(rf"dropped a frame that is not its receiver's: .*({match})", dropped.messages[0]), dropped.messages
    fresh_session_works(receiver_server, endpoint)


class DroppedFrames(logging.Handler):
    """The sender's log lines about frames it dropped; ``seen`` is set at the first."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        self.seen = threading.Event()
        self.logger = logging.getLogger("refitkit.transfer._ipc.sender")
        self.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if "dropped" in record.getMessage():
            self.messages.append(record.getMessage())
            self.seen.set()

    def close(self) -> None:
        self.logger.removeHandler(self)
        super().close()


def test_garbage_to_the_receiver(endpoint):
    context = zmq.Context()
    fake_sender = context.socket(zmq.ROUTER)
    fake_sender.setsockopt(zmq.LINGER, 0)
    fake_sender.bind(f"ipc://{socket_path(endpoint)}")
    try:
        receiver = BucketedWeightReceiver(endpoint, "cpu", timeout_s=TIMEOUT_S)

        def answer_with_garbage():
            if fake_sender.poll(int(TIMEOUT_S * 1000)):
                peer, _hello = fake_sender.recv_multipart()
                fake_sender.send_multipart([peer, b"\xff\x00not msgpack at all"])

        thread = threading.Thread(target=answer_with_garbage)
        thread.start()
        with pytest.raises(ProtocolError, match="undecodable"):
            receiver.receive(lambda weights, is_last: None)
        thread.join(TIMEOUT_S + 1)
    finally:
        fake_sender.close()
        context.term()


def test_raw_bytes_on_the_socket(receiver_server, endpoint):
    """Raw bytes framed the ZMTP/1.0 way reach the socket as a frame: garbage to us, dropped and logged (before: a
    ProtocolError that failed send()); the session then serves the real receiver."""
    dropped = DroppedFrames()
    try:
        with BucketedWeightSender(endpoint, bucket_bytes=BUCKET, timeout_s=TIMEOUT_S) as sender:
            outcome: list = []
            waiting = threading.Thread(target=lambda: outcome.append(sender.send(stream(3))))
            waiting.start()
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            raw.connect(sender.path)
            raw.sendall(b"\x01\x00" + b"\x08\x00garbage")  # legacy greeting (empty identity), then one frame
            assert dropped.seen.wait(TIMEOUT_S), "the sender logged no dropped frame"
            receiver_server.start_session(endpoint, timeout_s=TIMEOUT_S)
            waiting.join(TIMEOUT_S + 1)
            assert outcome and outcome[0].tensors == 3 and receiver_server.result()["ok"], outcome
            raw.close()
    finally:
        dropped.close()
    assert "dropped a frame that is not its receiver's: undecodable" in dropped.messages[0], dropped.messages
    fresh_session_works(receiver_server, endpoint)


def test_non_zmtp_bytes_are_dropped_and_the_session_succeeds(receiver_server, endpoint):
    with BucketedWeightSender(endpoint, bucket_bytes=BUCKET, timeout_s=TIMEOUT_S) as sender:
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(sender.path)
        raw.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
        receiver_server.start_session(endpoint, timeout_s=TIMEOUT_S)
        stats = sender.send(stream(3))
        raw.close()
    assert stats.tensors == 3 and receiver_server.result()["ok"]


def test_iter_weights_closed_early(receiver_server, endpoint):
    receiver_server.start_session(endpoint, timeout_s=TIMEOUT_S, mode="iter_close_early")
    error = send_expecting(endpoint, TransferError, "closed after 1 tensors")
    assert error.remote_message.startswith("iter_weights() was closed")
    assert receiver_server.result()["segments_after"] == []
    fresh_session_works(receiver_server, endpoint)
