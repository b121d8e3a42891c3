"""Hostile peers: a peer that speaks the protocol badly, or announces hand-offs for more buckets than were sent, cannot
make the other side crash, hang past timeout_s, or allocate or read out of bounds; the attacked side holds no bucket
afterwards. Attackers are raw ZMQ sockets speaking the wire format by hand; attacked sides are real."""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any

import msgpack
import pytest
import torch
import zmq

from refitkit.errors import InvalidInput, ProtocolError, TransferError
from refitkit.transfer import BucketedWeightReceiver, BucketedWeightSender
from refitkit.transfer._ipc import shm
from refitkit.transfer._ipc.endpoint import socket_path
from refitkit.transfer.protocol import MAX_FRAME_BYTES, MAX_IN_FLIGHT, WIRE_VERSION
from tests.transfer.harness import own_segment_files, spawn
from tests.transfer.peers import digest, mapped_segments

pytestmark = pytest.mark.timeout(120)

TIMEOUT_S = 4.0
HALF = 4096


def frame(kind: str, **fields: Any) -> bytes:
    return msgpack.packb({"v": WIRE_VERSION, "kind": kind, **fields}, use_bin_type=True)


def outcome(process, conn, within_s: float) -> dict[str, Any]:
    """The child's report, or a failure naming how it ended (hung past the bound, or killed by a signal)."""
    got = conn.poll(within_s)
    result = conn.recv() if got else None
    process.join(10 if got else 0.1)
    if process.is_alive():
        process.kill()
        process.join(5)
    assert result is not None, f"attacked side gave no result within {within_s} s (exit code {process.exitcode})"
    assert process.exitcode == 0, f"attacked side died with exit code {process.exitcode}: {result}"
    return result


# -- a rogue receiver announcing more than was sent -----------------------------------------------------------


def attacked_sender_main(endpoint: str, conn) -> None:
    torch.set_num_threads(1)
    weights = [(f"w{i}", torch.full((1000,), float(i))) for i in range(8)]  # one 4000-byte tensor a half
    with BucketedWeightSender(
        endpoint, bucket_bytes=2 * HALF, transport="shm", timeout_s=TIMEOUT_S, direct=False
    ) as sender:
        conn.send("bound")
        began = time.monotonic()
        try:
            sender.send(weights)
            result = {"type": None}
        except BaseException as exc:
            result = {"type": type(exc).__name__, "message": str(exc)}
        result["seconds"] = time.monotonic() - began
        result["left"] = own_segment_files()
    conn.send(result)


@pytest.mark.parametrize("times", [9, 100_000], ids=["one-more-than-all-buckets", "a-hundred-thousand"])
def test_done_beyond_the_buckets_sent_fails_the_sender_cleanly(endpoint, times):
    # A rogue receiver takes the setup, never maps the bucket, and sends done frames for more buckets than the
    # sender's 8 were: the sender calls the first done for a bucket it has not sent a ProtocolError, before timeout_s
    # (no loop over the flood), leaving no segment.
    process, conn = spawn(attacked_sender_main, endpoint)
    assert conn.poll(60) and conn.recv() == "bound"
    context = zmq.Context()
    rogue = context.socket(zmq.DEALER)
    try:
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.setsockopt(zmq.SNDHWM, 0)
        rogue.connect(f"ipc://{socket_path(endpoint)}")
        rogue.send(frame("hello", pid=os.getpid(), device="cpu", timeout_s=TIMEOUT_S))
        assert rogue.poll(20_000)
        setup = msgpack.unpackb(rogue.recv())
        assert setup["kind"] == "setup" and "control" not in setup, setup
        for seq in range(times):  # then never reads anything: the sender waits
            rogue.send(frame("done", session=setup["session"], seq=seq))
        result = outcome(process, conn, TIMEOUT_S + 15)
    finally:
        rogue.close()
        context.term()
    assert result["type"] == "ProtocolError", result
    assert re.search(r"unexpected done for bucket (\d+) \(sent (\d+) buckets\)", result["message"]), result
    sent = re.search(r"\(sent (\d+) buckets\)", result["message"])
    assert int(re.search(r"done for bucket (\d+)", result["message"]).group(1)) == int(sent.group(1)) <= 8, result
    assert result["seconds"] < TIMEOUT_S, result  # refused at the first look, not after timeout_s
    assert result["left"] == []


# -- a rogue sender speaking bad frames at a real receiver ----------------------------------------------


def run_rogue_sender(endpoint: str, setup_fields: dict[str, Any], frames: list[bytes]) -> tuple[type, str, float, list]:
    """A real receiver (this process) against a ROUTER that answers its hello with ``setup_fields`` (over a
    real shm bucket of two ``HALF`` halves), then ``frames``; returns what the receiver raised and the
    error frames it sent back."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{socket_path(endpoint)}")
    bucket = shm.ShmBucket(2 * HALF, session=os.urandom(4).hex())
    replies: list[dict[str, Any]] = []

    def rogue() -> None:
        if not router.poll(int(TIMEOUT_S * 1000)):
            return
        peer, hello = router.recv_multipart()
        fields = {"session": "s", "transport": "shm", "half_bytes": HALF, "handle": bucket.handle()}
        fields["exchange"] = msgpack.unpackb(hello)["exchange"]  # (the receiver takes only the answer to its hello)
        router.send_multipart([peer, frame("setup", **{**fields, **setup_fields})])
        for payload in frames:
            router.send_multipart([peer, payload])
        while router.poll(int(TIMEOUT_S * 1000)):
            replies.append(msgpack.unpackb(router.recv_multipart()[1]))
            if replies[-1]["kind"] == "error":
                return

    thread = threading.Thread(target=rogue)
    thread.start()
    try:
        receiver = BucketedWeightReceiver(endpoint, "cpu", timeout_s=TIMEOUT_S)
        began = time.monotonic()
        try:
            receiver.receive(lambda weights, is_last: None)
            raised: tuple[type, str] = (type(None), "")
        except Exception as exc:
            raised = (type(exc), str(exc))
        seconds = time.monotonic() - began
        thread.join(TIMEOUT_S + 2)
    finally:
        bucket.free()
        router.close()
        context.term()
    return raised[0], raised[1], seconds, replies


def bucket_frame(entries: Any, *, seq: Any = 0, last: Any = True, half: Any = 0, **extra: Any) -> bytes:
    return frame("bucket", session="s", seq=seq, half=half, wide=False, last=last, entries=entries, **extra)


def packed(seq: int) -> bytes:
    return frame("packed", session="s", seq=seq)


TiB4 = 4 << 40
NESTED: Any = "x"
for _ in range(500):  # msgpack packs (and unpacks) at most 511 levels
    NESTED = [NESTED]

BAD_FRAMES = {
    "half_bytes-not-int": ({"half_bytes": "4096"}, [], "setup: .*half_bytes='4096'"),
    "half_bytes-beyond-mapping": ({"half_bytes": 1 << 40}, [], "does not fit"),
    "handle-not-a-map": ({"handle": [1, 2]}, [], "setup: .*not a str, str, int and map"),
    "bucket-later-over-shm": ({"bucket_later": True}, [], "setup: bucket_later=True is only for a cuda_ipc session"),
    "bucket-later-not-bool": ({"bucket_later": 1}, [], "setup: bucket_later=1"),
    "direct-bucket-with-a-handle": (
        {},
        [
            bucket_frame(
                [["w", "float32", [4], 0]], direct={"exports": [], "allocs": [0]}, handle={"ipc_handle": b"x" * 64}
            )
        ],
        "direct bucket 0 also announces a bucket handle",
    ),
    "second-bucket-handle": (
        {},
        [bucket_frame([["w", "float32", [4], 0]], handle={"ipc_handle": b"x" * 64})],
        "announces a bucket handle .* is mapped already",
    ),
    "negative-offset": ({}, [bucket_frame([["w", "float32", [4], -256]])], "bad name, shape or byte range"),
    "offset-beyond-half": ({}, [bucket_frame([["w", "float32", [4], HALF]])], "bad name, shape or byte range"),
    "negative-length": ({}, [bucket_frame([["w", "uint8", [1 << 20], 0, 0, -5]])], "bad name, shape or byte range"),
    "shape-overflows-int64": ({}, [bucket_frame([["w", "float64", [1 << 40, 1 << 40], 0, 0, 256]])], "overflows int64"),
    "empty-shape-whose-strides-overflow": (
        {},
        [bucket_frame([["w", "float32", [0, 1 << 40, 1 << 40], 0]])],
        "overflows int64",
    ),
    "4TiB-split-entry": (
        {},
        [bucket_frame([["w", "uint8", [TiB4], 0, 0, HALF]], last=False), packed(0)],
        "larger than the .* bytes of memory of cpu; refusing",
    ),
    "split-changes-shape": (
        {},
        [
            bucket_frame([["w", "uint8", [3 * HALF], 0, 0, HALF]], last=False),
            packed(0),
            bucket_frame([["w", "uint8", [4 * HALF], 0, HALF, HALF]], seq=1, half=1, last=True),
            packed(1),
        ],
        "does not match its first piece",
    ),
    "two-splits-at-once": (
        {},
        [
            bucket_frame([["a", "uint8", [3 * HALF], 0, 0, HALF]], last=False),
            packed(0),
            bucket_frame([["b", "uint8", [3 * HALF], 0, 0, HALF]], seq=1, half=1, last=True),
            packed(1),
        ],
        "starts while 'a' is incomplete",
    ),
    "last-bucket-with-split-incomplete": ({}, [bucket_frame([["w", "uint8", [3 * HALF], 0, 0, HALF]])], "incomplete"),
    "seq-as-bool": ({}, [bucket_frame([], seq=False)], "bucket frame seq=False"),
    "half-as-bool": ({}, [bucket_frame([], half=True)], "bucket frame .*half=True"),
    "packed-far-ahead": (
        {},
        [*(packed(seq) for seq in range(MAX_IN_FLIGHT + 1)), bucket_frame([["w", "float32", [4], 0]])],
        f"packed frame for bucket {MAX_IN_FLIGHT}",
    ),
    "deep-nesting": ({}, [bucket_frame([NESTED])], "malformed bucket entry"),
    "wrong-version": ({}, [msgpack.packb({"v": WIRE_VERSION + 1, "kind": "bucket"})], "wire version"),
}


@pytest.mark.parametrize("setup_fields, frames, match", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
def test_bad_frames_to_the_receiver(endpoint, setup_fields, frames, match):
    kind, message, seconds, replies = run_rogue_sender(endpoint, setup_fields, frames)
    assert kind is ProtocolError, (kind, message)
    assert re.search(match, message), message
    assert len(message) < 2000  # a hostile frame is quoted briefly
    assert seconds < TIMEOUT_S  # refused at once, not after a timeout
    assert mapped_segments() == []  # the receiver released the bucket (and the rogue freed its own)
    assert replies and replies[-1]["kind"] == "error", replies  # and told the sender why


# -- a rogue receiver speaking bad frames at a real sender ----------------------------------------------


def test_oversized_frame_is_never_buffered_by_the_sender(receiver_server, endpoint):
    context = zmq.Context()
    rogue = context.socket(zmq.DEALER)
    try:
        with BucketedWeightSender(endpoint, bucket_bytes=2 * HALF, timeout_s=TIMEOUT_S, direct=False) as sender:
            rogue.setsockopt(zmq.LINGER, 0)
            rogue.connect(f"ipc://{sender.path}")
            rogue.send(b"\0" * (MAX_FRAME_BYTES + 1))  # the sender's socket drops the connection instead
            time.sleep(0.5)  # let it arrive (or be dropped) before the real receiver says hello
            receiver_server.start_session(endpoint, timeout_s=TIMEOUT_S)
            weights = [(f"w{i}", torch.full((1000,), float(i))) for i in range(3)]
            stats = sender.send(weights)
        assert stats.tensors == 3
        result = receiver_server.result()
        assert result["ok"] and result["digests"] == {name: digest(tensor) for name, tensor in weights}, result
    finally:
        rogue.close()
        context.term()


def test_flood_of_hellos_from_one_peer_is_a_protocol_error(receiver_server, endpoint):
    context = zmq.Context()
    rogue = context.socket(zmq.DEALER)
    try:
        with BucketedWeightSender(endpoint, bucket_bytes=2 * HALF, timeout_s=TIMEOUT_S, direct=False) as sender:
            rogue.setsockopt(zmq.LINGER, 0)
            rogue.connect(f"ipc://{sender.path}")
            for _ in range(2000):
                rogue.send(frame("hello", pid=1, device="cpu", timeout_s=TIMEOUT_S))
            began = time.monotonic()
            with pytest.raises(ProtocolError, match="expected a ready/done/released frame, got 'hello'"):
                sender.send([(f"w{i}", torch.full((1000,), float(i))) for i in range(6)])
            assert time.monotonic() - began < TIMEOUT_S
            assert own_segment_files() == [] and mapped_segments() == []
            rogue.close()
            weights = [("w", torch.arange(100.0))]
            receiver_server.start_session(endpoint, timeout_s=TIMEOUT_S)
            sender.send(weights)  # the flood is gone with the failed session's socket
        assert receiver_server.result()["ok"]
    finally:
        rogue.close()
        context.term()


def test_flood_of_hellos_from_many_peers_stays_bounded(receiver_server, endpoint):
    """Hellos that arrive during a session wait for the next one, at most a fixed number of them."""
    context = zmq.Context()
    rogues = []
    try:
        with BucketedWeightSender(endpoint, bucket_bytes=2 * HALF, timeout_s=TIMEOUT_S, direct=False) as sender:
            receiver_server.start_session(endpoint, timeout_s=TIMEOUT_S)

            def weights():
                yield "w0", torch.zeros(1000)
                if not rogues:  # mid-session: 100 other peers say hello
                    for _ in range(100):
                        rogue = context.socket(zmq.DEALER)
                        rogue.setsockopt(zmq.LINGER, 0)
                        rogue.connect(f"ipc://{sender.path}")
                        rogue.send(frame("hello", pid=1, device="cpu", timeout_s=TIMEOUT_S))
                        rogues.append(rogue)
                    time.sleep(0.3)
                yield "w1", torch.ones(1000)

            sender.send(weights())
            assert receiver_server.result()["ok"]
            assert len(sender._waiting._queue) <= 16
    finally:
        for rogue in rogues:
            rogue.close()
        context.term()


# -- interrupts in the loader, and knobs ----------------------------------------------------------------


def interrupted_receiver_main(endpoint: str, how: str, conn) -> None:
    torch.set_num_threads(1)
    receiver = BucketedWeightReceiver(endpoint, "cpu", timeout_s=30)
    conn.send("ready")
    try:
        if how == "on_bucket":

            def on_bucket(weights, is_last):
                raise SystemExit("loader asked to exit")

            receiver.receive(on_bucket)
        else:
            weights = receiver.iter_weights()
            next(weights)
            weights.throw(KeyboardInterrupt("Ctrl-C while loading"))  # what a signal does at the yield
        conn.send({"type": None})
    except BaseException as exc:
        conn.send({"type": type(exc).__name__, "message": str(exc), "mapped": mapped_segments()})


@pytest.mark.parametrize("how", ["on_bucket", "iter_weights"])
def test_interrupt_in_the_loader_reaches_the_sender_at_once(endpoint, how):
    with BucketedWeightSender(endpoint, bucket_bytes=2 * HALF, timeout_s=30, direct=False) as sender:
        process, conn = spawn(interrupted_receiver_main, endpoint, how)
        assert conn.poll(60) and conn.recv() == "ready"
        began = time.monotonic()
        with pytest.raises(TransferError, match="SystemExit|KeyboardInterrupt") as raised:
            sender.send([(f"w{i}", torch.full((1000,), float(i))) for i in range(6)])
        assert time.monotonic() - began < 10  # an error frame, not the 30 s timeout
        assert "SystemExit" in raised.value.remote_message or "KeyboardInterrupt" in raised.value.remote_message
    result = outcome(process, conn, 20)
    assert result["type"] == ("SystemExit" if how == "on_bucket" else "KeyboardInterrupt"), result  # re-raised as is
    assert result["mapped"] == [], result


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_receiver_without_cuda_is_invalid_input(endpoint):
    with pytest.raises(InvalidInput, match="sees no CUDA device"):
        BucketedWeightReceiver(endpoint, "cuda")
    with pytest.raises(InvalidInput, match="is not a device"):
        BucketedWeightReceiver(endpoint, "gpu:zero")


def test_wait_on_is_for_cuda_streams_of_a_running_session(receiver_server, endpoint):
    receiver = BucketedWeightReceiver(endpoint, "cpu", timeout_s=TIMEOUT_S)
    with pytest.raises(InvalidInput, match="running session"):
        receiver.wait_on()
    with BucketedWeightSender(endpoint, bucket_bytes=2 * HALF, timeout_s=TIMEOUT_S, direct=False) as sender:
        sent: list[BaseException] = []

        def send() -> None:
            try:
                sender.send([("w", torch.zeros(4))])
            except TransferError as exc:
                sent.append(exc)

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        with pytest.raises(TransferError, match=r"InvalidInput: wait_on\('not a stream'\)"):
            receiver.receive(lambda weights, is_last: receiver.wait_on("not a stream"))
        thread.join(TIMEOUT_S + 2)
        assert sent and "wait_on" in str(sent[0])  # the sender heard why
    assert mapped_segments() == [] and own_segment_files() == []


# -- a loader that reads the bucket on its own stream (CUDA) ---------------------------------------------


def side_stream_loader_main(endpoint: str, conn) -> None:
    """Copies every tensor on a side stream that is busy first (so the copies run late) and hands that
    stream to the receiver: the bucket's half must not be handed back before those copies ran."""
    torch.set_num_threads(1)
    torch.zeros(1, device="cuda")
    receiver = BucketedWeightReceiver(endpoint, "cuda", timeout_s=30)
    side = torch.cuda.Stream()
    kept: dict[str, torch.Tensor] = {}

    def on_bucket(weights, is_last):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time before the copies
            for name, tensor in weights:
                kept[name] = tensor.clone()
        receiver.wait_on(side)

    conn.send("ready")
    try:
        receiver.receive(on_bucket)
        torch.cuda.synchronize()
        conn.send({"type": None, "digests": {name: digest(tensor) for name, tensor in kept.items()}})
    except BaseException as exc:
        conn.send({"type": type(exc).__name__, "message": str(exc)})


@pytest.mark.cuda
def test_loader_copying_on_a_side_stream_reads_its_own_bucket(endpoint):
    weights = [(f"w{i}", torch.full((1000,), float(i), device="cuda")) for i in range(12)]  # one a half
    expected = {name: digest(tensor) for name, tensor in weights}
    with BucketedWeightSender(
        endpoint, bucket_bytes=2 * HALF, transport="cuda_ipc", timeout_s=30, direct=False
    ) as sender:
        process, conn = spawn(side_stream_loader_main, endpoint)
        assert conn.poll(120) and conn.recv() == "ready"
        sender.send((name, tensor) for name, tensor in weights)  # a generator: one tensor a bucket, halves reused
    result = outcome(process, conn, 60)
    assert result["type"] is None, result
    assert result["digests"] == expected
