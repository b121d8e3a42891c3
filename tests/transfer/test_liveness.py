"""Liveness: a peer that dies mid-sync ends the other side's call within a second, told by its connection, not by
``timeout_s``; a failed sync ends that sync and never the next; frames that are not the peer's are dropped; a sync
has a total bound; and a side waiting on a silent peer costs next to no CPU.

Real processes, real sockets, the shm transport (the CUDA IPC cases run on the GPU machine).
"""

from __future__ import annotations

import glob
import logging
import os
import re
import threading
import time
from typing import Any

import msgpack
import psutil
import pytest
import torch
import zmq

from refitkit.errors import InvalidInput, PeerGone, TransferError, TransferTimeout
from refitkit.transfer import BucketedWeightReceiver, BucketedWeightSender
from refitkit.transfer._ipc.endpoint import socket_path
from refitkit.transfer.protocol import WIRE_VERSION
from tests.helpers import procs
from tests.transfer.harness import (
    Case,
    assert_device_memory_back,
    device_free_bytes,
    own_segment_files,
    receiver_killed_at,
    roundtrip,
    spawn,
)
from tests.transfer.peers import digest, garbage_main, killed_sender_main, looping_receiver_main, mapped_segments

pytestmark = pytest.mark.timeout(120)

TIMEOUT_S = 30.0  # what a dead peer must NOT be noticed by
NOTICED_S = 1.5  # the whole call, the death's notice (within 1 s) included
BUCKET = 8192  # halves of 4096 bytes: one 4000-byte tensor a bucket

KILL_CASES = [
    pytest.param(Case("shm", "cpu", "cpu"), id="shm-cpu"),
    pytest.param(Case("cuda_ipc", "cuda", "cuda"), id="cuda_ipc", marks=pytest.mark.cuda),
]


def stream(count: int, device: str = "cpu", prefix: str = "w") -> list[tuple[str, torch.Tensor]]:
    return [(f"{prefix}{i}", torch.full((1000,), float(i), device=device)) for i in range(count)]


def segments_of(*pids: int) -> list[str]:
    """Named segments in /dev/shm of these processes (other tests of this uid may run beside us: only ours)."""
    return [name for pid in pids for name in glob.glob(f"/dev/shm/refitkit-{os.getuid()}-{pid}-*")]


def sender_on(endpoint: str, transport: str, timeout_s: float) -> BucketedWeightSender:
    """A sender of small buckets through the bucket (these are the bucket path's waits)."""
    return BucketedWeightSender(endpoint, bucket_bytes=BUCKET, transport=transport, timeout_s=timeout_s, direct=False)


def fresh_pair_syncs(server, endpoint: str, case: Case) -> None:
    """A new sender and a new receiver session on the same endpoint sync bit-exactly (roundtrip checks digests)."""
    roundtrip(server, endpoint, stream(3, case.tensor_device), bucket_bytes=BUCKET, case=case)


# -- a peer SIGKILLed mid-sync --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", KILL_CASES)
def test_a_receiver_killed_after_its_first_bucket_ends_the_send_within_a_second(receiver_server, endpoint, case):
    """Before: the sender waited for the dead receiver's "done" until timeout_s (30.0 s after the kill)."""
    baseline_free = None
    if case.tensor_device == "cuda":  # both processes ran this path once: not a leak of the kill's
        fresh_pair_syncs(receiver_server, endpoint, case)
        baseline_free = device_free_bytes()
    weights = stream(8, case.tensor_device)  # 8 buckets: the sender must wait for the receiver to free a half
    with sender_on(endpoint, case.transport, TIMEOUT_S) as sender:
        with receiver_killed_at(endpoint, 2, device=case.receiver_device, timeout_s=TIMEOUT_S) as victim:
            began = time.monotonic()
            with pytest.raises(PeerGone) as raised:
                sender.send(weights)
            seconds = time.monotonic() - began
        assert seconds < NOTICED_S, f"noticed after {seconds:.2f} s: {raised.value}"
        message = str(raised.value)
        gone = rf"(streaming|draining): the receiver on '{endpoint}' \(pid {victim}\) is gone "
        assert re.match(gone, message), message
        assert re.search(r"bucket \d+", message) and "timeout_s" not in message, message
        assert own_segment_files() == [] and mapped_segments() == []  # the bucket is freed, nothing mapped
    assert segments_of(os.getpid(), victim) == []
    if baseline_free is not None:  # our bucket at once; the victim's memory once the driver tore its context down
        assert_device_memory_back(baseline_free, f"{case}: after the receiver was SIGKILLed", settle_s=10.0)
    fresh_pair_syncs(receiver_server, endpoint, case)


@pytest.mark.parametrize("case", KILL_CASES)
def test_a_sender_killed_mid_stream_ends_the_receive_within_a_second(receiver_server, endpoint, case):
    """Before: the receiver waited for the dead sender's next bucket until timeout_s (30.03 s after the kill)."""
    ctx = procs.context()
    conn, child = ctx.Pipe()
    victim = ctx.Process(
        target=killed_sender_main, args=(endpoint, BUCKET, 3, child, case.transport, case.tensor_device), daemon=True
    )
    victim.start()
    assert conn.poll(60)
    victim_pid = conn.recv()  # bound: its socket is there
    receiver = BucketedWeightReceiver(endpoint, case.receiver_device, timeout_s=TIMEOUT_S)
    seen: list[bool] = []
    began = time.monotonic()
    with pytest.raises(PeerGone) as raised:
        receiver.receive(lambda weights, is_last: seen.append(is_last))
    seconds = time.monotonic() - began
    victim.join(10)
    assert victim.exitcode == -9 and seen and not any(seen)
    assert seconds < NOTICED_S, f"noticed after {seconds:.2f} s: {raised.value}"
    message = str(raised.value)
    assert re.match(rf"streaming: the sender on '{endpoint}' is gone ", message), message
    assert re.search(r"bucket \d+", message) and "INCOMPLETE" in message and "timeout_s" not in message, message
    assert mapped_segments() == [] and segments_of(victim_pid) == []  # unmapped; its names unlinked once mapped
    fresh_pair_syncs(receiver_server, endpoint, case)


@pytest.mark.parametrize("case", KILL_CASES)
def test_a_receiver_killed_while_a_forked_child_holds_its_socket_ends_the_send_within_a_second(
    receiver_server, endpoint, case
):
    """The child keeps the dead receiver's connection open (fork copies descriptors): its process tells.
    Before: the sender waited until the child left (HOLDER_S)."""
    weights = stream(8, case.tensor_device)
    with sender_on(endpoint, case.transport, TIMEOUT_S) as sender:
        with receiver_killed_at(
            endpoint, 2, device=case.receiver_device, timeout_s=TIMEOUT_S, mode="kill_forked"
        ) as victim:
            began = time.monotonic()
            with pytest.raises(PeerGone) as raised:
                sender.send(weights)
            seconds = time.monotonic() - began
        assert seconds < NOTICED_S, f"noticed after {seconds:.2f} s: {raised.value}"
        assert re.match(
            rf"(streaming|draining): the receiver on '{endpoint}' \(pid {victim}\) is gone ", str(raised.value)
        )
        assert own_segment_files() == [] and mapped_segments() == []
    fresh_pair_syncs(receiver_server, endpoint, case)


@pytest.mark.parametrize("case", KILL_CASES)
def test_a_sender_killed_while_a_forked_child_holds_its_socket_ends_the_receive_within_a_second(
    receiver_server, endpoint, case
):
    """The trainer's forked DataLoader workers keep its connection open after it died: its process tells.
    Before: the receiver waited until the child left (HOLDER_S)."""
    ctx = procs.context()
    conn, child = ctx.Pipe()
    victim = ctx.Process(
        target=killed_sender_main,
        args=(endpoint, BUCKET, 3, child, case.transport, case.tensor_device, True),
        daemon=True,
    )
    victim.start()
    assert conn.poll(60)
    conn.recv()
    receiver = BucketedWeightReceiver(endpoint, case.receiver_device, timeout_s=TIMEOUT_S)
    began = time.monotonic()
    with pytest.raises(PeerGone) as raised:
        receiver.receive(lambda weights, is_last: None)
    seconds = time.monotonic() - began
    victim.join(10)
    assert victim.exitcode == -9
    assert seconds < NOTICED_S, f"noticed after {seconds:.2f} s: {raised.value}"
    assert re.match(rf"streaming: the sender on '{endpoint}' is gone ", str(raised.value)), raised.value
    assert mapped_segments() == []
    receiver.close()
    # (the child also holds the dead sender's bound socket until it leaves: the endpoint is "in use" until then)
    fresh_pair_syncs(receiver_server, f"{endpoint}-next", case)


# -- a failure ends one sync, never the next ------------------------------------------------------------------


def test_syncs_alternating_with_failed_ones_lose_no_hello_and_wait_out_no_timeout(endpoint):
    """100 syncs of one sender to one receiver that loops on receive(): every other one fails (the receiver's
    loader raises, or the sender's generator yields a bad item). Before: after a failed sync the sender bound its
    socket anew; a hello said meanwhile was lost (both sides then waited timeout_s), and a receiver whose hello
    was already queued was turned away ("say hello again"), failing a sync that should have run."""
    syncs, timeout_s = 100, 10.0
    receiver, conn = spawn(looping_receiver_main, endpoint, syncs, timeout_s)
    kinds = ("good", "receiver error", "good", "bad item")
    try:
        with sender_on(endpoint, "shm", timeout_s) as sender:
            assert conn.poll(60) and conn.recv() == "ready"
            for index in range(syncs):
                kind = kinds[index % len(kinds)]
                weights = stream(3, prefix=f"s{index}w")
                began = time.monotonic()
                if kind == "good":
                    assert sender.send(weights).tensors == 3
                elif kind == "receiver error":
                    with pytest.raises(TransferError, match="the loader refused 'explode'"):
                        sender.send([("explode", torch.zeros(1000)), *weights])
                else:

                    def bad_item():
                        yield from weights[:2]
                        yield "w-bad", "not a tensor"

                    with pytest.raises(InvalidInput, match="w-bad"):
                        sender.send(bad_item())
                seconds = time.monotonic() - began
                assert seconds < timeout_s / 2, f"sync {index} ({kind}) took {seconds:.2f} s"
                assert conn.poll(timeout_s), f"the receiver reported nothing for sync {index} ({kind})"
                outcome = conn.recv()
                assert outcome["seconds"] < timeout_s / 2 and outcome["segments_after"] == [], (index, kind, outcome)
                if kind == "good":
                    assert outcome["ok"] and outcome["digests"] == {n: digest(t) for n, t in weights}, (index, outcome)
                elif kind == "receiver error":
                    assert not outcome["ok"] and outcome["message"].startswith("on_bucket raised RuntimeError"), outcome
                else:
                    assert not outcome["ok"] and outcome["type"] == "TransferError", (index, outcome)
                    assert "aborted the session" in outcome["message"] and "w-bad" in outcome["message"], outcome
                assert own_segment_files() == [] and mapped_segments() == []
    finally:
        receiver.join(10)
        if receiver.is_alive():
            receiver.kill()
            receiver.join(5)
    assert receiver.exitcode == 0


def test_frames_from_a_third_process_do_not_abort_a_running_send(receiver_server, endpoint, caplog):
    """Garbage, another wire version, a well-formed frame of a session it never had and a three-part message,
    from a third process of our uid while a send() runs: each is dropped and logged, and the sync succeeds.
    Before: the first of them raised ProtocolError in send() and aborted the receiver."""
    weights = stream(8)
    with sender_on(endpoint, "shm", 10.0) as sender:
        rogue, conn = spawn(garbage_main, sender.path)
        assert conn.poll(60) and conn.recv() == "ready"  # (started before the sync: a spawn can take seconds)
        receiver_server.start_session(endpoint, timeout_s=10.0, mode="stall", arg=0.5)  # a slow first bucket

        def paced():
            yield weights[0]
            conn.send("go")
            assert conn.poll(10) and conn.recv() == "sent"  # they are on their way while the sender waits
            yield from weights[1:]

        try:
            with caplog.at_level(logging.WARNING, logger="refitkit.transfer._ipc.sender"):
                stats = sender.send(paced())
        finally:
            conn.send("bye")
            rogue.join(10)
    assert stats.tensors == len(weights)
    result = receiver_server.result()
    assert result["ok"] and result["digests"] == {name: digest(tensor) for name, tensor in weights}, result
    dropped = [record.getMessage() for record in caplog.records if "dropped" in record.getMessage()]
    assert len(dropped) >= 3, caplog.text  # the undecodable, the other version's and the three-part frame


def test_a_receiver_closing_after_its_final_ack_is_not_taken_for_dead(endpoint):
    """The final ACK is the ``released`` frame, and the receiver closes its socket right after it: every one of these
    syncs must succeed, none raise PeerGone."""
    weights = stream(4)
    outcomes: list[Any] = []

    def receive_all() -> None:
        for _ in range(30):
            try:
                got: dict[str, Any] = {}
                BucketedWeightReceiver(endpoint, "cpu", timeout_s=10.0).receive(
                    lambda batch, last: got.update((name, digest(tensor)) for name, tensor in batch)
                )
                outcomes.append(got)
            except Exception as exc:
                outcomes.append(exc)

    with sender_on(endpoint, "shm", 10.0) as sender:
        thread = threading.Thread(target=receive_all)
        thread.start()
        try:
            for _ in range(30):
                assert sender.send(weights).tensors == 4
        finally:
            thread.join(30)
    assert outcomes == [{name: digest(tensor) for name, tensor in weights}] * 30


# -- a sync has a total bound -----------------------------------------------------------------------------------


def test_a_sender_that_never_sends_the_last_bucket_is_cut_off_by_max_sync_s(endpoint):
    """A peer that keeps sending non-last buckets, each in time: every wait is bounded by timeout_s, the sync by
    max_sync_s. Before: the receiver took buckets for as long as the peer sent them."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{socket_path(endpoint)}")
    stop = threading.Event()

    def endless() -> None:
        def frame(kind: str, **fields: Any) -> bytes:
            return msgpack.packb({"v": WIRE_VERSION, "kind": kind, **fields}, use_bin_type=True)

        if not router.poll(10_000):
            return
        peer, hello = router.recv_multipart()
        exchange = msgpack.unpackb(hello)["exchange"]  # (the receiver takes only the setup that answers its hello)
        setup = frame("setup", session="s", exchange=exchange, transport="none", half_bytes=0, handle={})
        router.send_multipart([peer, setup])
        seq = 0
        while not stop.is_set() and seq < 2000:  # 20 s at most, past the bound but far within timeout_s each
            bucket = frame("bucket", session="s", seq=seq, half=0, wide=False, last=False, entries=[])
            router.send_multipart([peer, bucket])
            seq += 1
            while router.poll(10):
                router.recv_multipart()  # its "ready" and "done" frames

    thread = threading.Thread(target=endless)
    thread.start()
    try:
        receiver = BucketedWeightReceiver(endpoint, "cpu", timeout_s=TIMEOUT_S, max_sync_s=1.0)
        calls: list[bool] = []
        began = time.monotonic()
        with pytest.raises(TransferTimeout, match=r"streaming: .* max_sync_s=1\b") as raised:
            receiver.receive(lambda weights, is_last: calls.append(is_last))
        seconds = time.monotonic() - began
        assert 1.0 <= seconds < 2.0, seconds
        assert len(calls) > 10 and not any(calls), len(calls)
        assert not isinstance(raised.value, PeerGone)
        assert mapped_segments() == []
    finally:
        stop.set()
        thread.join(30)
        router.close()
        context.term()


def test_max_sync_s_is_checked(endpoint):
    with pytest.raises(InvalidInput, match="max_sync_s"):
        BucketedWeightReceiver(endpoint, "cpu", max_sync_s=0)


# -- waiting on a silent peer costs next to no CPU ------------------------------------------------------------


def cpu_share(process: psutil.Process, seconds: float) -> float:
    """The share of one core ``process`` used over the next ``seconds`` (user and system time, all its threads)."""
    before = process.cpu_times()
    began = time.monotonic()
    time.sleep(seconds)  # the measurement window, not a synchronisation
    after = process.cpu_times()
    used = (after.user - before.user) + (after.system - before.system)
    return used / (time.monotonic() - began)


def test_a_sender_waiting_on_a_silent_receiver_uses_at_most_2_percent_of_a_core(receiver_server, endpoint):
    """The receiver's loader takes 4.5 s over its first bucket; the sender meanwhile waits for it to free a half
    (blocked on the socket, which also sees the connection end)."""
    with sender_on(endpoint, "shm", TIMEOUT_S) as sender:
        receiver_server.start_session(endpoint, timeout_s=TIMEOUT_S, mode="stall", arg=4.5)
        failures: list[BaseException] = []
        thread = threading.Thread(target=lambda: _send_catching(sender, stream(6), failures))
        thread.start()
        try:
            time.sleep(0.5)  # well into its wait: the handshake and two buckets take milliseconds
            share = cpu_share(psutil.Process(), 3.0)
        finally:
            thread.join(30)
    assert failures == [] and receiver_server.result()["ok"]
    assert share <= 0.02, f"the waiting sender used {share:.1%} of a core"


def test_a_receiver_waiting_on_a_silent_sender_uses_at_most_2_percent_of_a_core(receiver_server, endpoint):
    """The sender's generator stalls 4 s after its first buckets; the receiver meanwhile waits for the next one."""
    gate, stalled = threading.Event(), threading.Event()
    weights = stream(6)

    def slow():
        yield from weights[:3]
        stalled.set()
        gate.wait(30)
        yield from weights[3:]

    with sender_on(endpoint, "shm", TIMEOUT_S) as sender:
        receiver_server.start_session(endpoint, timeout_s=TIMEOUT_S)
        failures: list[BaseException] = []
        thread = threading.Thread(target=lambda: _send_catching(sender, slow(), failures))
        thread.start()
        try:
            assert stalled.wait(30)
            time.sleep(0.3)  # the receiver has taken what came and waits for the next bucket
            share = cpu_share(psutil.Process(receiver_server.info["pid"]), 3.0)
        finally:
            gate.set()
            thread.join(30)
    assert failures == [] and receiver_server.result()["ok"]
    assert share <= 0.02, f"the waiting receiver used {share:.1%} of a core"


def _send_catching(sender: BucketedWeightSender, weights: Any, failures: list[BaseException]) -> None:
    try:
        sender.send(weights)
    except BaseException as exc:  # the test looks at it after the join
        failures.append(exc)


CHURN_SCRIPT = """
import sys, time, zmq
from refitkit.transfer import SenderChannel
sender = SenderChannel(sys.argv[1], transport="shm", timeout_s=10.0)
context = zmq.Context()
for _ in range(int(sys.argv[2])):  # receivers that come and go while no sync runs: two monitor events each
    peer = context.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(f"ipc://{sender.path}")
    peer.send(b"x")
    time.sleep(0.002)
    peer.close()
time.sleep(0.5)
sender.close()
context.term()
print("closed")
"""


def test_a_channel_whose_connection_events_nobody_read_still_closes(endpoint):
    """2500 receivers connect and leave a sender channel between syncs: 5000 monitor events, more than the monitor
    pair's default high-water marks (2000). Before: libzmq's I/O thread blocked sending the next event while holding
    the socket's monitor lock, and close() (disable_monitor) waited on that lock forever (seen as a test process that
    never exited)."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", CHURN_SCRIPT, endpoint, "2500"], capture_output=True, text=True, timeout=90
    )
    assert run.returncode == 0 and run.stdout.strip() == "closed", (run.returncode, run.stderr[-2000:])
