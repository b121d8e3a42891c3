"""Bucket hand-offs (``packed`` / ``done`` frames) and batched packing."""

from __future__ import annotations

import glob
import os
import signal
import threading
import time

import msgpack
import pytest
import torch
import zmq

from refitkit.engines import HeldWeights
from refitkit.errors import TransferError
from refitkit.transfer import BucketedWeightReceiver, BucketedWeightSender, packing
from refitkit.transfer._ipc import shm
from refitkit.transfer._ipc.endpoint import socket_path
from refitkit.transfer.protocol import MAX_IN_FLIGHT, SUPPORTED_DTYPES, WIRE_VERSION
from tests.helpers import procs
from tests.transfer.harness import Case, own_segment_files, roundtrip
from tests.transfer.peers import digest, mapped_segments, one_shot_receiver_main
from tests.transfer.test_roundtrip import random_tensor

pytestmark = pytest.mark.timeout(60)


def mixed_stream(count: int = 120) -> list[tuple[str, torch.Tensor]]:
    dtypes = [torch.bfloat16, torch.float32, torch.int8, torch.float16]
    weights = [(f"w{i}", random_tensor((i % 9 + 1, 37), dtypes[i % 4], seed=i)) for i in range(count)]
    weights.insert(7, ("strided", random_tensor((40, 30), torch.float32, seed=99).t()))
    weights.insert(50, ("wide", random_tensor((3000,), torch.float32, seed=98)))  # 12000 bytes > a half of 8192
    weights.insert(90, ("split", random_tensor((9000,), torch.float32, seed=97)))  # 36000 bytes > the buffer
    return weights


def test_many_buckets_round_trip_bit_exact_with_every_hand_off_a_frame(receiver_server, endpoint, case):
    # 120 tensors in halves of 8 KiB: far more buckets than may be in flight at once (MAX_IN_FLIGHT), each bucket's
    # half reused only once the receiver's done frame came, each read only once the sender's packed frame came
    # (on CUDA: after the events of the copies and reads).
    weights = [(name, tensor.to(case.tensor_device)) for name, tensor in mixed_stream()]
    stats, result = roundtrip(receiver_server, endpoint, weights, bucket_bytes=16 << 10, case=case)
    assert stats.buckets > 3 * MAX_IN_FLIGHT and result["calls"][-1][1] is True


def test_no_segment_is_left_after_a_session_or_a_failed_one(receiver_server, endpoint):
    roundtrip(receiver_server, endpoint, mixed_stream(), bucket_bytes=16 << 10)
    assert own_segment_files() == [] and mapped_segments() == []
    receiver_server.start_session(endpoint, timeout_s=10, mode="raise", arg=3)
    with BucketedWeightSender(endpoint, bucket_bytes=16 << 10, transport="shm", timeout_s=10, direct=False) as sender:
        with pytest.raises(TransferError, match="loader exploded at bucket 3"):
            sender.send(mixed_stream())
        assert own_segment_files() == [] and mapped_segments() == []  # (before the sender is closed)
    result = receiver_server.result()
    assert not result["ok"] and result["segments_after"] == []


def named_segments_of(pid: int) -> list[str]:
    """This uid's named segment files of process ``pid`` in /dev/shm."""
    return sorted(glob.glob(f"/dev/shm/{shm.segment_prefix()}{pid}-*"))


def stalled_sender_main(endpoint: str, conn) -> None:
    """A sender whose receiver never answers past the setup: it holds its segment until the test kills it."""
    torch.set_num_threads(1)
    with BucketedWeightSender(endpoint, bucket_bytes=16 << 10, transport="shm", timeout_s=60, direct=False) as sender:
        conn.send(os.getpid())
        sender.send(mixed_stream())


def test_the_segment_of_a_sigkilled_sender_is_swept_by_the_next_sender(endpoint):
    # A receiver that says no PID namespace gets a named segment, unlinked once it mapped it; a sender killed before
    # that leaves the file behind, which the next sender removes (its lock went with the dead sender), while a live
    # sender's stays: nothing of a killed sender is left in /dev/shm.
    ctx = procs.context()
    parent, child = ctx.Pipe()
    sender = ctx.Process(target=stalled_sender_main, args=(endpoint, child), daemon=True)
    sender.start()
    context = zmq.Context()
    rogue = context.socket(zmq.DEALER)
    try:
        assert parent.poll(60)
        pid = parent.recv()
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(f"ipc://{socket_path(endpoint)}")
        hello = {"v": WIRE_VERSION, "kind": "hello", "pid": os.getpid(), "device": "cpu", "timeout_s": 60}
        rogue.send(msgpack.packb(hello))
        assert rogue.poll(30_000)
        setup = msgpack.unpackb(rogue.recv())
        files = [setup["handle"]["path"]]
        assert named_segments_of(pid) == files
        shm.remove_stale_segments()
        assert named_segments_of(pid) == files  # alive: its lock keeps it
        os.kill(pid, signal.SIGKILL)
        sender.join(30)
        assert named_segments_of(pid) == files
        BucketedWeightSender(f"{endpoint}-next", timeout_s=1).close()  # a new sender sweeps
        assert named_segments_of(pid) == []
    finally:
        rogue.close()
        context.term()
        if sender.is_alive():
            sender.kill()


@pytest.mark.parametrize("batch_max_bytes", [0, 256, 1 << 30], ids=["no-batching", "some-batched", "all-batched"])
def test_batched_and_single_copies_mix(receiver_server, endpoint, monkeypatch, batch_max_bytes, case):
    # Small contiguous tensors of a list are copied in runs (one cat each), the rest one by one: every
    # split between the two paths must arrive bit-exact. (These sizes are mostly not multiples of
    # ALIGN_BYTES, so most runs hold one tensor; test_runs_of_small_tensors has long runs.)
    monkeypatch.setattr(packing, "BATCH_MAX_BYTES", batch_max_bytes)
    weights = [(name, tensor.to(case.tensor_device)) for name, tensor in mixed_stream()]
    stats, _ = roundtrip(receiver_server, endpoint, weights, bucket_bytes=16 << 10, case=case)
    assert stats.tensors == 123


def run_stream(device: str) -> list[tuple[str, torch.Tensor]]:
    """Runs of ALIGN_BYTES-multiple tensors of one dtype, broken by every kind of tensor that ends a run."""
    weights = []
    for block, dtype in enumerate(sorted(SUPPORTED_DTYPES.values(), key=str)):  # every dtype a run can hold
        per_row = 256 // dtype.itemsize
        weights += [
            (f"b{block}.w{i}", random_tensor((i % 3 + 1, per_row), dtype, device, seed=10 * block + i))
            for i in range(7)
        ]
    weights.insert(3, ("zero", random_tensor((0, 5), torch.bfloat16, device)))  # zero bytes: the run goes on
    weights.insert(5, ("odd", random_tensor((3, 3), torch.bfloat16, device, seed=90)))  # 18 bytes: ends its run
    weights.insert(9, ("strided", random_tensor((16, 8), torch.float32, device, seed=91).t()))  # copied alone
    # Lazy conj/neg views (made on the device: .to() would resolve them) are copied alone, by copy_.
    weights.insert(20, ("conj", random_tensor((32,), torch.complex64, device, seed=92).conj()))
    weights.insert(25, ("neg", torch._neg_view(random_tensor((64,), torch.float32, device, seed=93))))
    weights.append(("big", random_tensor((3000,), torch.float32, device, seed=94)))  # wider than a half: a wide bucket
    return weights


def counted_runs(monkeypatch) -> list[int]:
    """The length of every run the packer copies with one cat, in order (filled as runs end)."""
    runs: list[int] = []
    end_run = packing.BucketPacker._end_run

    def counting_end_run(self):
        if self._run:
            runs.append(len(self._run))
        end_run(self)

    monkeypatch.setattr(packing.BucketPacker, "_end_run", counting_end_run)
    return runs


def test_runs_of_small_tensors_round_trip(receiver_server, endpoint, monkeypatch, case):
    # Consecutive batched tensors of one dtype lie back to back and are copied by one cat per run; a
    # dtype change, an odd size, a strided/conj/neg tensor, a full bucket and the end all end a run.
    runs = counted_runs(monkeypatch)
    weights = run_stream(case.tensor_device)
    assert [name for name, tensor in weights if tensor.is_conj() or tensor.is_neg()] == ["conj", "neg"]
    expected = {name: digest(tensor.resolve_conj().resolve_neg()) for name, tensor in weights}
    stats, _ = roundtrip(receiver_server, endpoint, weights, bucket_bytes=16 << 10, case=case, expected=expected)
    batched = len(weights) - 3  # all but strided, conj and neg; "big" (12000 bytes) is below BATCH_MAX_BYTES
    if (case.transport == "shm") == (case.tensor_device == "cpu"):  # tensors on the buffer's device
        assert sum(runs) == batched and max(runs) >= 5, runs
    else:  # CUDA tensors into a host shm buffer: one copy each
        assert runs == []
    assert stats.tensors == len(weights) == 7 * len(SUPPORTED_DTYPES) + 6


def test_a_modules_own_tensors_are_copied_in_runs_and_other_generators_one_by_one(
    receiver_server, endpoint, monkeypatch, case
):
    # torch's named_parameters() and a state_dict's items() yield tensors that stay as they are while send()
    # pulls the rest: their small copies are batched like a list's (one cat per run). A generator over the
    # very same tensors is one refitkit cannot vouch for (it might refill a buffer): one copy per tensor.
    runs = counted_runs(monkeypatch)
    torch.manual_seed(5)
    module = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(6))).to(case.tensor_device)
    expected = {name: digest(tensor) for name, tensor in module.state_dict().items()}
    on_buffer_device = (case.transport == "shm") == (case.tensor_device == "cpu")
    sources = {
        "named_parameters": (module.named_parameters(), on_buffer_device),
        "state_dict items": (iter(module.state_dict().items()), on_buffer_device),
        "an adapter's stream that says so": (HeldWeights(iter(module.state_dict().items())), on_buffer_device),
        "a plain generator": (((name, tensor) for name, tensor in module.named_parameters()), False),
    }
    for label, (source, batched) in sources.items():
        runs.clear()
        roundtrip(receiver_server, endpoint, source, bucket_bytes=16 << 10, case=case, expected=expected)
        if batched:
            assert sum(runs) == 12 and max(runs) >= 2, (label, runs)  # 6 weights + 6 biases, weights run on
        else:
            assert runs == [], (label, runs)


def test_list_smaller_than_the_bucket_gets_a_buffer_of_its_size(receiver_server, endpoint, monkeypatch):
    # The buffer is allocated and freed every session (on the H200, freeing 2 GiB took 1.2-2.4 ms in
    # a session, 1.1 GiB 0.65-1.0 ms): a list whose tensors need less than bucket_bytes gets only
    # what it needs; a generator, whose size is unknown, gets the whole bucket.
    made: list[int] = []
    make = shm.ShmBucket.__init__

    def recording_init(self, nbytes, **kwargs):
        made.append(nbytes)
        make(self, nbytes, **kwargs)

    monkeypatch.setattr(shm.ShmBucket, "__init__", recording_init)
    few = [(f"w{i}", random_tensor((3 << 18,), torch.float32, seed=i)) for i in range(4)]  # 4 x 3 MiB
    roundtrip(receiver_server, endpoint, few, bucket_bytes=64 << 20)
    roundtrip(receiver_server, endpoint, few, bucket_bytes=64 << 20, generator=True)
    # 130 x 64 KiB: BUCKET_MAX_TENSORS (64) makes 3 buckets anyway, so a half needs a third of them.
    many = [(f"m{i}", random_tensor((1 << 14,), torch.float32, seed=i)) for i in range(130)]
    stats, _ = roundtrip(receiver_server, endpoint, many, bucket_bytes=64 << 20)
    # Halves of whole MiB: 12 MiB + padding in halves of 7 MiB; 8.1 MiB + padding in thirds of 3 MiB.
    assert made == [2 * (7 << 20), 64 << 20, 2 * (3 << 20)]
    assert stats.buckets == 3


def test_hello_during_a_session_is_served_next(endpoint):
    # Two receivers ask at once: one is served now, the other's hello (read while the first session
    # runs) waits for the next send() instead of being turned away.
    ctx = procs.context()
    peers = []
    weights = [(f"w{i}", torch.full((2048,), float(i))) for i in range(400)]  # ~200 buckets: a long session
    with BucketedWeightSender(endpoint, bucket_bytes=16 << 10, transport="shm", timeout_s=20, direct=False) as sender:
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


def test_queued_hello_of_a_receiver_that_gave_up_is_skipped(endpoint):
    # B says hello during A's session and gives up before it is served; the next send() must serve
    # the live receiver C instead of failing on B's dead connection.
    outcomes: dict[str, str] = {}
    b_gave_up = threading.Event()

    def receive(tag: str, timeout_s: float, on_bucket=lambda weights, is_last: None) -> None:
        try:
            BucketedWeightReceiver(endpoint, "cpu", timeout_s=timeout_s).receive(on_bucket)
            outcomes[tag] = "ok"
        except TransferError as exc:
            outcomes[tag] = type(exc).__name__
        finally:
            if tag == "B":
                b_gave_up.set()

    def slow_loader(weights, is_last):  # A's session lasts until B has given up
        if not b_gave_up.is_set():
            threading.Thread(target=receive, args=("B", 0.5)).start()
            assert b_gave_up.wait(10)

    weights = [("w", torch.ones(8))]
    with BucketedWeightSender(endpoint, bucket_bytes=1 << 20, transport="shm", timeout_s=10, direct=False) as sender:
        a = threading.Thread(target=receive, args=("A", 10, slow_loader))
        a.start()
        sender.send(weights)
        a.join(10)
        c = threading.Thread(target=receive, args=("C", 10))
        c.start()
        sender.send(weights)
        c.join(10)
    assert outcomes == {"A": "ok", "B": "TransferTimeout", "C": "ok"}


def refilled_staging_buffer(device: str):
    """A generator that refills one staging tensor per item (what a gather loop with a reused buffer does)."""
    staging = torch.empty(64, device=device)
    for index in range(200):
        staging.fill_(float(index))
        yield f"w{index}", staging


def test_generator_reusing_one_buffer_arrives_intact(receiver_server, endpoint, case):
    expected = {f"w{i}": digest(torch.full((64,), float(i))) for i in range(200)}
    roundtrip(
        receiver_server,
        endpoint,
        refilled_staging_buffer(case.tensor_device),
        bucket_bytes=16 << 10,
        case=case,
        expected=expected,
    )


@pytest.mark.parametrize("generator", [False, True], ids=["list", "generator"])
def test_conj_and_neg_views_arrive_resolved(receiver_server, endpoint, case, generator):
    # Lazy conj/neg views (made on the device: .to() would resolve them), small ones and ones larger
    # than the whole bucket (split into byte ranges), arrive as their values, not their raw bytes.
    gen = torch.Generator().manual_seed(5)
    small = torch.randn(3, dtype=torch.complex64, generator=gen).to(case.tensor_device)
    big = torch.randn(3000, dtype=torch.complex64, generator=gen).to(case.tensor_device)  # 24000 B > 16 KiB
    weights = [
        ("conj", small.conj()),
        ("neg", torch._neg_view(small)),
        ("big_conj", big.conj()),
        ("big_neg", torch._neg_view(big)),
        ("plain", torch.arange(8.0).to(case.tensor_device)),
    ]
    assert [tensor.is_conj() or tensor.is_neg() for _, tensor in weights] == [True] * 4 + [False]
    expected = {name: digest(tensor.resolve_conj().resolve_neg()) for name, tensor in weights}
    roundtrip(
        receiver_server, endpoint, weights, bucket_bytes=16 << 10, case=case, expected=expected, generator=generator
    )


@pytest.mark.cuda
def test_copies_on_a_side_stream_are_complete_before_free(receiver_server, endpoint):
    # The caller's generator keeps its own stream current across yields: the copies, the events recorded
    # behind them and the final synchronize all follow that stream, not the default one.
    side = torch.cuda.Stream()

    def on_side_stream():
        with torch.cuda.stream(side):
            for index in range(100):
                yield f"w{index}", torch.full((4096,), float(index), device="cuda")

    expected = {f"w{i}": digest(torch.full((4096,), float(i))) for i in range(100)}
    case = Case("cuda_ipc", "cuda", "cuda")
    roundtrip(receiver_server, endpoint, on_side_stream(), bucket_bytes=64 << 10, case=case, expected=expected)


def test_the_receivers_phases_say_where_its_session_went(endpoint):
    """``last_timings_s``: the caller's on_bucket, the waits for a slow sender, and nothing counted twice (the
    phases of a session fit inside its seconds)."""
    from refitkit.transfer._ipc.receiver import RECEIVE_PHASES

    loader_s, sender_pause_s = 0.03, 0.05
    result: dict[str, object] = {}
    receiver = BucketedWeightReceiver(endpoint, "cpu", timeout_s=10)

    def loader(weights, is_last):
        time.sleep(loader_s)  # the caller's work per bucket

    def receive() -> None:
        result["stats"] = receiver.receive(loader)

    def slow_source():
        for index in range(3):
            if index:
                time.sleep(sender_pause_s)  # the receiver waits for this bucket's frame
            yield f"w{index}", torch.full((4096,), float(index))

    thread = threading.Thread(target=receive)
    thread.start()
    with BucketedWeightSender(
        endpoint, bucket_bytes=4 * 4096 * 4, transport="shm", timeout_s=10, direct=False
    ) as sender:
        sender.send(slow_source())
    thread.join(10)
    stats, phases = result["stats"], receiver.last_timings_s
    assert set(phases) == set(RECEIVE_PHASES)
    assert stats.buckets >= 2 and phases["on_bucket"] >= stats.buckets * loader_s  # type: ignore[attr-defined]
    assert phases["frames"] + phases["packed"] >= sender_pause_s
    within = ("handshake", "frames", "packed", "map", "on_bucket", "release")
    assert sum(phases[phase] for phase in within) <= stats.seconds  # type: ignore[attr-defined]
    assert phases["handshake"] > 0 and phases["release"] > 0
