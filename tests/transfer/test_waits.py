"""Waits block in the kernel: a side waiting on a silent peer sleeps (it uses at most 2 % of a core), and one that
waits past ``timeout_s`` says so. Both sides are real processes over the shm transport, hand-offs as frames."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import msgpack
import pytest
import torch
import zmq

from refitkit.errors import TransferTimeout
from refitkit.transfer import BucketedWeightReceiver, BucketedWeightSender
from refitkit.transfer._ipc import handoff, shm
from refitkit.transfer._ipc.endpoint import socket_path
from refitkit.transfer.common import SessionPhase
from refitkit.transfer.protocol import WIRE_VERSION
from tests.transfer.harness import spawn
from tests.transfer.peers import digest

pytestmark = pytest.mark.timeout(120)

SILENT_S = 3.0  # how long the peer stays silent
MOST_OF_A_CORE = 0.02  # what a waiting side may use of one core meanwhile
HALF = 4096
WEIGHTS = [(f"w{i}", torch.full((1000,), float(i))) for i in range(6)]  # one 4000-byte tensor a half: 6 buckets


def cpu_share(run: Any) -> tuple[Any, float, float]:
    """``run()``'s result, its wall seconds and the share of one core this process (all its threads, ZMQ's I/O
    thread included) used meanwhile."""
    wall, cpu = time.monotonic(), time.process_time()
    result = run()
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    return result, wall, cpu / wall


def report(process, conn, within_s: float) -> dict[str, Any]:
    assert conn.poll(within_s), f"no report within {within_s} s (exit code {process.exitcode})"
    result = conn.recv()
    process.join(10)
    return result


# -- a sender waiting on a silent receiver -------------------------------------------------------------------


def stalling_receiver_main(endpoint: str, conn) -> None:
    """Two sessions: the first as usual, the second stalls SILENT_S in its loader at the first bucket."""
    torch.set_num_threads(1)
    receiver = BucketedWeightReceiver(endpoint, "cpu", timeout_s=60)
    receiver.receive(lambda weights, is_last: None)

    def stall_once(weights, is_last, stalled=[]):  # noqa: B006 (the one stall of this session)
        if not stalled:
            stalled.append(True)
            time.sleep(SILENT_S)  # the caller's loader, busy elsewhere: the sender waits for this bucket's release

    conn.send(receiver.receive(stall_once).buckets)


def measured_sender_main(endpoint: str, conn) -> None:
    torch.set_num_threads(1)
    with BucketedWeightSender(endpoint, bucket_bytes=2 * HALF, transport="shm", timeout_s=60, direct=False) as sender:
        sender.send(WEIGHTS)  # the first session: one-time costs (imports) are not the wait
        stats, wall, share = cpu_share(lambda: sender.send(WEIGHTS))
    conn.send({"buckets": stats.buckets, "ack_wait_s": stats.ack_wait_s, "wall": wall, "share": share})


def test_a_sender_waiting_on_a_silent_receiver_sleeps(endpoint):
    receiver, from_receiver = spawn(stalling_receiver_main, endpoint)
    sender, from_sender = spawn(measured_sender_main, endpoint)
    result = report(sender, from_sender, 90)
    assert report(receiver, from_receiver, 30) == len(WEIGHTS) == result["buckets"]
    assert result["ack_wait_s"] >= SILENT_S * 0.9, result  # the sender did wait for the receiver
    assert result["share"] <= MOST_OF_A_CORE, f"the waiting sender used {result['share']:.1%} of a core: {result}"


# -- a receiver waiting on a silent sender -------------------------------------------------------------------


def pausing_sender_main(endpoint: str, conn) -> None:
    """Two sessions: the first as usual, the second pauses SILENT_S after its first bucket shipped."""
    torch.set_num_threads(1)

    def pausing():
        for index, item in enumerate(WEIGHTS):
            if index == 2:  # buckets 0 and 1 are out: the receiver waits for bucket 2's frame
                time.sleep(SILENT_S)  # the trainer's generator, busy elsewhere (a gather)
            yield item

    with BucketedWeightSender(endpoint, bucket_bytes=2 * HALF, transport="shm", timeout_s=60, direct=False) as sender:
        sender.send(WEIGHTS)
        conn.send(sender.send(pausing()).buckets)


def measured_receiver_main(endpoint: str, conn) -> None:
    torch.set_num_threads(1)
    receiver = BucketedWeightReceiver(endpoint, "cpu", timeout_s=60)
    receiver.receive(lambda weights, is_last: None)
    got: dict[str, Any] = {}

    def collect(weights, is_last):
        got.update((name, digest(tensor)) for name, tensor in weights)

    stats, wall, share = cpu_share(lambda: receiver.receive(collect))
    conn.send({"buckets": stats.buckets, "wall": wall, "share": share, "intact": got == dict(DIGESTS)})


DIGESTS = [(name, digest(tensor)) for name, tensor in WEIGHTS]


def test_a_receiver_waiting_on_a_silent_sender_mid_stream_sleeps(endpoint):
    receiver, from_receiver = spawn(measured_receiver_main, endpoint)
    sender, from_sender = spawn(pausing_sender_main, endpoint)
    result = report(receiver, from_receiver, 90)
    assert report(sender, from_sender, 30) == len(WEIGHTS) == result["buckets"] and result["intact"], result
    assert result["wall"] >= SILENT_S, result
    assert result["share"] <= MOST_OF_A_CORE, f"the waiting receiver used {result['share']:.1%} of a core: {result}"


def receiver_until_timeout_main(endpoint: str, conn) -> None:
    torch.set_num_threads(1)
    receiver = BucketedWeightReceiver(endpoint, "cpu", timeout_s=SILENT_S)
    conn.send("ready")

    def receive() -> str:
        try:
            receiver.receive(lambda weights, is_last: None)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "received"

    outcome, wall, share = cpu_share(receive)
    conn.send({"outcome": outcome, "wall": wall, "share": share})


def test_a_receiver_waiting_for_bytes_that_never_complete_sleeps_and_times_out_naming_timeout_s(endpoint):
    # A sender that shipped a bucket's frame and never sends its packed frame (its copies never finish): the receiver
    # waits on the socket until its timeout_s, then says what it waited for and the knob.
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{socket_path(endpoint)}")
    bucket = shm.ShmBucket(2 * HALF, session="5a1e57")
    try:
        receiver, from_receiver = spawn(receiver_until_timeout_main, endpoint)
        assert from_receiver.poll(60) and from_receiver.recv() == "ready"
        assert router.poll(20_000)
        peer, hello = router.recv_multipart()

        def send(kind: str, **fields: Any) -> None:
            router.send_multipart([peer, msgpack.packb({"v": WIRE_VERSION, "kind": kind, **fields})])

        exchange = msgpack.unpackb(hello)["exchange"]  # (the receiver takes only the setup that answers its hello)
        send(
            "setup",
            session="s",
            exchange=exchange,
            transport="shm",
            half_bytes=HALF,
            handle=bucket.handle(),
        )
        send("bucket", session="s", seq=0, half=0, wide=False, last=True, entries=[["w", "float32", [4], 0]])
        result = report(receiver, from_receiver, SILENT_S + 30)
    finally:
        bucket.free()
        router.close()
        context.term()
    assert result["outcome"].startswith("TransferTimeout: streaming: no bucket 0 from the sender (its frame came, its")
    assert f"timeout_s={SILENT_S:g}" in result["outcome"], result
    assert SILENT_S <= result["wall"] < SILENT_S + 2, result
    assert result["share"] <= MOST_OF_A_CORE, f"the waiting receiver used {result['share']:.1%} of a core: {result}"


# -- a side waiting on its own CUDA work (the GPU machine) -----------------------------------------------------

STALL_S = 3.0  # how long the GPU work queued before a side's copies runs
CUDA_WEIGHTS = 6  # one 64 KiB tensor a half when bucketed: 6 buckets


def cuda_weights() -> list[tuple[str, torch.Tensor]]:
    return [(f"c{i}", torch.full((16384,), float(i), device="cuda")) for i in range(CUDA_WEIGHTS)]


def stall_gpu(seconds: float) -> None:
    """Queue ``seconds`` of GPU work on the current stream (calibrated on this GPU's clock, here)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    cycles_per_s = 50_000_000 / (start.elapsed_time(end) / 1000)
    torch.cuda._sleep(int(cycles_per_s * seconds))


def cuda_receiver_main(endpoint: str, bucketed: bool, conn) -> None:
    """Two sessions on CUDA; with ``bucketed`` the second one's loader queues STALL_S of GPU work at its first bucket
    (the receiver's reads, and its done, come after it), measured."""
    torch.set_num_threads(1)
    receiver = BucketedWeightReceiver(endpoint, "cuda", timeout_s=60)
    receiver.receive(lambda weights, is_last: None)
    copies: dict[str, torch.Tensor] = {}

    def collect(weights, is_last, stalled=[]):  # noqa: B006 (the one stall of this session)
        if bucketed and not stalled:
            stalled.append(True)
            stall_gpu(STALL_S)
        copies.update((name, tensor.clone()) for name, tensor in weights)  # queued after the stall: no wait here

    stats, wall, share = cpu_share(lambda: receiver.receive(collect))
    got = {name: digest(tensor.cpu()) for name, tensor in copies.items()}
    want = {name: digest(tensor.cpu()) for name, tensor in cuda_weights()}
    conn.send({"buckets": stats.buckets, "wall": wall, "share": share, "intact": got == want})


def cuda_sender_main(endpoint: str, bucketed: bool, conn) -> None:
    """Two sessions on CUDA; unless ``bucketed`` the second one's tensors come after STALL_S of GPU work queued on
    the current stream (its packed frame waits for it), measured."""
    torch.set_num_threads(1)
    weights = cuda_weights()
    options: dict[str, Any] = {"bucket_bytes": 2 * 65536, "direct": False} if bucketed else {}
    with BucketedWeightSender(endpoint, transport="cuda_ipc", timeout_s=60, **options) as sender:
        sender.send(weights)

        def stalled_send():
            if not bucketed:
                stall_gpu(STALL_S)
            return sender.send(weights)

        stats, wall, share = cpu_share(stalled_send)
    conn.send({"buckets": stats.buckets, "wall": wall, "share": share})


@pytest.mark.cuda
@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_a_side_waiting_on_its_own_cuda_work_sleeps(endpoint, side):
    # The sender's tensors (direct) or the receiver's reads (bucketed) come after STALL_S of GPU work: the side waits
    # for it before its packed / done frame, asleep in the driver, and the session still ends intact. (A wait that
    # looks at the events in a loop uses a whole core for STALL_S.)
    bucketed = side == "receiver"
    receiver, from_receiver = spawn(cuda_receiver_main, endpoint, bucketed)
    sender, from_sender = spawn(cuda_sender_main, endpoint, bucketed)
    sent = report(sender, from_sender, 120)
    received = report(receiver, from_receiver, 30)
    assert received["intact"] and sent["buckets"] == received["buckets"], (sent, received)
    measured = sent if side == "sender" else received
    assert measured["wall"] >= STALL_S * 0.5, measured  # the side did wait for the GPU work (its clock varies)
    assert measured["share"] <= MOST_OF_A_CORE, f"the waiting {side} used {measured['share']:.1%} of a core: {measured}"


# -- the bound of a wait on this side's own GPU work (the wait's logic on the CPU) -------------------------------


class StuckEvent:
    """Stands in for a CUDA event (none on the CPU) whose queued work does not end until ``release`` is set, as a
    collective waiting on a dead rank; only its ``query`` / ``synchronize`` are used by the wait."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def query(self) -> bool:
        return self.release.is_set()

    def synchronize(self) -> None:
        self.release.wait(60)


def test_a_wait_on_own_gpu_work_that_never_ends_is_bounded_and_names_timeout_s():
    event = StuckEvent()
    pending = deque([(3, event)])
    began = time.monotonic()
    with pytest.raises(TransferTimeout) as raised:
        handoff.OwnWork().wait(pending, left_s=0.5, timeout_s=7.0, phase=SessionPhase.STREAMING)
    assert 0.5 <= time.monotonic() - began < 1.5
    assert str(raised.value).startswith(
        "streaming: the CUDA work queued on this side before bucket 3's hand-off did not finish within timeout_s=7 "
    )
    event.release.set()  # the stuck helper ends with its event


def test_a_wait_on_own_gpu_work_returns_as_it_ends_and_leaves_no_thread():
    event = StuckEvent()
    threading.Timer(0.2, event.release.set).start()
    began = time.monotonic()
    handoff.OwnWork().wait(deque([(0, event)]), left_s=10.0, timeout_s=10.0, phase=SessionPhase.DRAINING)
    assert 0.2 <= time.monotonic() - began < 2.0
    assert not [thread for thread in threading.enumerate() if thread.name == handoff.HELPER]


def test_own_gpu_work_longer_than_the_senders_cancel_slice_is_waited_out_by_one_helper():
    """The sender looks for a cancellation every CANCEL_SLICE_S (50 ms), so it waits on its own CUDA work in slices.
    Before: the slice was taken for the deadline, and a trainer whose stream held more than 50 ms of work ahead of its
    weights (the GPU suite's side-stream items behind 0.1 s kernels) failed with a false TransferTimeout; a wait in
    slices must not raise before ``left_s``, nor start a helper thread per slice."""
    event = StuckEvent()
    pending = deque([(0, event)])
    work = handoff.OwnWork()
    threading.Timer(0.3, event.release.set).start()
    began = time.monotonic()
    slices = 0
    while pending:
        work.wait(pending, left_s=10.0, slice_s=0.05, timeout_s=10.0, phase=SessionPhase.STREAMING)
        slices += 1
        helpers = [thread for thread in threading.enumerate() if thread.name == handoff.HELPER]
        assert len(helpers) <= 1, helpers
        if event.query():
            pending.popleft()
    assert 0.3 <= time.monotonic() - began < 2.0
    assert slices >= 3  # it did come back between slices, each time to the same helper
    assert not [thread for thread in threading.enumerate() if thread.name == handoff.HELPER]
