"""The torch.distributed broadcast over gloo on 127.0.0.1: one sender (this process), two spawned receivers.

Bit-exact round trips for every wire dtype (tensors wider than a half and larger than the bucket
included), then the fault cases: a receiver killed mid-broadcast, one that never joins, a peer
without the secret, garbage in the store and on the group's metadata channel. Each ends in the
right refitkit error on every side within timeout_s + 2 s, leaves no process hanging (every
receiver answers its next command), and a fresh session then lands whole on both receivers.
"""

from __future__ import annotations

import datetime
import threading
import time

import msgpack
import pytest
import torch
import torch.distributed as dist

from refitkit.errors import (
    InvalidInput,
    PeerGone,
    ProtocolError,
    RefitError,
    RemoteError,
    TransferError,
    TransferTimeout,
)
from refitkit.transfer import BroadcastWeightReceiver, WeightVersion
from refitkit.transfer._broadcast import group as grp
from refitkit.transfer._broadcast.sender import BroadcastWeightSender
from refitkit.transfer.protocol import SUPPORTED_DTYPES, encode
from tests.helpers import procs
from tests.helpers.ports import free_port
from tests.transfer.broadcast_peers import ReceiverProcess, killed_sender_main
from tests.transfer.peers import digest

pytestmark = pytest.mark.timeout(240)

TIMEOUT_S = 3.0
BOUND_S = TIMEOUT_S + 2.0
SECRET = "job-secret-0123456789abcdef"
BUCKET = 1 << 16  # halves of 32 KiB


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random raw bytes seen as ``dtype`` (NaN payloads, subnormals and all: the check is on bytes); bools 0 or 1,
    the only bytes a bool may hold."""
    generator = torch.Generator().manual_seed(seed)
    count = 1
    for size in shape:
        count *= size
    raw = torch.randint(
        0, 2 if dtype is torch.bool else 256, (count * dtype.itemsize,), dtype=torch.uint8, generator=generator
    )
    return raw.view(dtype).view(shape)


def stream(tag: float = 0.0, count: int = 6) -> list[tuple[str, torch.Tensor]]:
    return [(f"s{i}", torch.full((3000,), tag + i)) for i in range(count)]  # 12 KB each: 2 per bucket


class World:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.sender = BroadcastWeightSender(
            self.url, secret=SECRET, receivers=2, bucket_bytes=BUCKET, timeout_s=TIMEOUT_S
        )
        self.receivers = {1: ReceiverProcess(), 2: ReceiverProcess()}
        self.version = 0
        self.landed: int | None = None  # the last version that reached both receivers whole

    def respawn(self, rank: int) -> None:
        self.receivers[rank].close()
        self.receivers[rank] = ReceiverProcess()

    def start(self, modes: dict[int, str] | None = None, secret: str = SECRET) -> None:
        for rank, process in self.receivers.items():
            mode = (modes or {}).get(rank, "ok")
            if mode != "absent":
                process.start(self.url, secret if rank == 2 else SECRET, rank, mode, TIMEOUT_S)

    def send(self, weights, expect: type[BaseException] | None = None) -> tuple[float, BaseException | None]:
        self.version += 1
        start = time.monotonic()
        try:
            self.sender.send(weights, version=self.version)
        except Exception as exc:
            if expect is None or not isinstance(exc, expect):
                raise
            return time.monotonic() - start, exc
        if expect is not None:
            raise AssertionError(f"send() did not raise {expect.__name__}")
        return time.monotonic() - start, None

    def fresh_session_lands(self) -> None:
        weights = stream(tag=100.0 * self.version)
        self.start()
        self.send(weights)
        want = {name: digest(tensor) for name, tensor in weights}
        for process in self.receivers.values():
            error, message, _, got, version = process.result()
            assert error is None, message
            assert got == want
            assert version == (self.version, None)
        self.landed = self.version


@pytest.fixture(scope="module")
def world():
    made = World()
    yield made
    codes = [process.close() for process in made.receivers.values()]
    assert codes == [0, 0], f"receiver processes did not exit cleanly: {codes}"


def test_every_dtype_bit_exact_on_both_receivers(world):
    weights = [
        (f"{name}.w", random_tensor(dtype, (7, 13), seed))
        for seed, (name, dtype) in enumerate(SUPPORTED_DTYPES.items())
    ]
    weights += [
        ("wide", random_tensor(torch.float32, (48, 256), 90)),  # 48 KiB: more than a half, whole in a wide bucket
        ("split.bf16", random_tensor(torch.bfloat16, (300, 257), 91)),  # 150 KiB: split across buckets
        ("split.c64", random_tensor(torch.complex64, (5000, 3), 92)),  # 117 KiB, split
        ("empty", torch.empty(0, 4)),
        ("strided", random_tensor(torch.float16, (64, 64), 93).t()),  # non-contiguous: sent as its values
    ]
    want = {name: digest(tensor) for name, tensor in weights}
    for as_given in (weights, iter(weights)):  # a list is checked whole and batched; a generator item by item
        world.start()
        world.send(as_given)
        for process in world.receivers.values():
            error, message, _, got, version = process.result()
            assert error is None, message
            assert got == want
            assert version == (world.version, None)
        world.landed = world.version
    assert world.sender.half_bytes == BUCKET // 2
    assert not dist.is_initialized()  # every session used a group of its own, never a default group


def test_receiver_killed_mid_broadcast(world):
    world.start({2: "kill"})
    seconds, error = world.send(stream(count=12), expect=TransferTimeout)
    assert seconds < BOUND_S
    assert "broke" in str(error) or "no progress" in str(error)
    assert "bucket" in str(error) and "receiver rank" in str(error)
    survivor = world.receivers[1].result(timeout_s=BOUND_S + 5)
    assert survivor[0] in ("TransferError", "TransferTimeout", "PeerGone"), survivor
    assert survivor[2] < TIMEOUT_S - 1.0, survivor  # told by the sender's abort, not by its own timeout
    assert survivor[4] == (world.landed, world.version)  # partly updated: reported incomplete
    world.receivers[2].process.join(10)
    assert world.receivers[2].process.exitcode == -9
    world.respawn(2)
    world.fresh_session_lands()  # and receiver 1 is clean again


def test_receiver_failure_reaches_sender_with_its_message(world):
    world.start({1: "raise"})
    seconds, error = world.send(stream(count=12), expect=TransferError)
    assert seconds < BOUND_S
    assert "receiver rank 1 failed" in str(error) and "loader refused bucket 1 (test)" in error.remote_message
    # the loader's exception travelled as data: its type, message and frames, as the cause of the sender's error
    assert error.remote_type == "RuntimeError" and "broadcast_peers.py" in error.remote_traceback
    assert 'raise RuntimeError("loader refused bucket 1 (test)")' in error.remote_traceback
    assert type(error.__cause__) is RemoteError and error.__cause__.remote_message == "loader refused bucket 1 (test)"
    failed, other = world.receivers[1].result(), world.receivers[2].result()
    assert failed[0] == "RuntimeError" and failed[4] == (world.landed, world.version)
    assert other[0] in ("TransferError", "PeerGone") and other[2] < TIMEOUT_S - 1.0
    world.fresh_session_lands()


def test_sender_killed_mid_broadcast_is_peer_gone_naming_rank_0():
    """The receiver meets the sender's death as PeerGone (the group's connection or the sender's store broke, torch
    says which), naming the sender's rank, the phase and timeout_s, with torch's error chained; long before timeout_s."""
    kill_at_item = 8  # 4 buckets of 2 items went out: the receiver is streaming
    ctx = procs.context()
    parent, child = ctx.Pipe()
    url = f"tcp://127.0.0.1:{free_port()}"
    victim = ctx.Process(target=killed_sender_main, args=(url, SECRET, BUCKET, kill_at_item, child))
    victim.start()
    try:
        assert parent.poll(120) and parent.recv() == "up"
        receiver = BroadcastWeightReceiver(url, secret=SECRET, rank=1, timeout_s=TIMEOUT_S)
        landed: list[str] = []
        began = time.monotonic()
        with pytest.raises(PeerGone) as raised:
            receiver.receive(lambda weights, last: landed.extend(name for name, _ in weights))
        seconds = time.monotonic() - began
    finally:
        victim.join(30)
    assert victim.exitcode == -9 and seconds < TIMEOUT_S
    message = str(raised.value)
    assert (
        message.startswith("streaming: ") and "the sender (rank 0)" in message and f"timeout_s={TIMEOUT_S:g}" in message
    )
    cause = raised.value.__cause__
    assert isinstance(cause, RuntimeError) and not isinstance(cause, RefitError), repr(cause)  # torch's own, chained
    assert receiver.weights_version.incomplete == (1 if landed else None)


def test_sender_generator_raising_mid_stream(world):
    def weights():
        yield from stream(count=8)
        raise ValueError("the trainer's generator broke (test)")

    world.start()
    seconds, error = world.send(weights(), expect=ValueError)
    assert seconds < BOUND_S and "generator broke" in str(error)
    for process in world.receivers.values():
        told = process.result()
        assert told[0] == "TransferError" and "ValueError: the trainer's generator broke (test)" in told[1]
        assert told[2] < TIMEOUT_S - 1.0 and told[4] == (world.landed, world.version)  # 4 buckets applied: incomplete
    world.fresh_session_lands()
    assert world.sender.group_id is not None  # kept for the next sync: only its rendezvous keys remain
    assert not [
        key
        for key in world.sender._store.list_keys()
        if key.startswith(grp.PREFIX) and "/pg/" in key and not key.startswith(f"{grp.PREFIX}{world.sender.group_id}/")
    ]


def test_receiver_that_never_joins(world):
    world.start({2: "absent"})
    seconds, error = world.send(stream(), expect=TransferTimeout)
    assert TIMEOUT_S - 0.5 < seconds < BOUND_S
    assert "receiver rank(s) 2 did not join" in str(error) and "timeout_s=3" in str(error)
    waiting = world.receivers[1].result()
    assert waiting[0] == "TransferError" and "called session" in waiting[1] and waiting[2] < BOUND_S
    assert waiting[4] == (world.landed, None)  # nothing was handed out: the weights are untouched
    world.fresh_session_lands()


def test_wrong_secret_gets_nothing(world):
    world.start(secret="not-the-job-secret-0000000")
    seconds, error = world.send(stream(), expect=TransferTimeout)
    assert seconds < BOUND_S and "receiver rank(s) 2 did not join" in str(error)
    intruder = world.receivers[2].result()
    assert intruder[0] == "ProtocolError" and "failed the secret check" in intruder[1]
    assert intruder[2] < BOUND_S and intruder[3] == {}
    honest = world.receivers[1].result()
    assert honest[0] == "TransferError" and honest[2] < BOUND_S
    world.fresh_session_lands()


def test_forged_join_is_refused_before_any_weight(world):
    """An intruder on the network reads the offer from the (unauthenticated) store and claims rank 2."""
    world.start({2: "absent"})
    intruder = dist.TCPStore("127.0.0.1", world.port, is_master=False, timeout=datetime.timedelta(seconds=5))

    def forge() -> None:
        deadline = time.monotonic() + BOUND_S
        while not intruder.check([grp.PREFIX + "offer"]):
            if time.monotonic() > deadline:
                raise AssertionError("no offer to forge a join for")
            time.sleep(0.01)
        offer = msgpack.unpackb(bytes(intruder.get(grp.PREFIX + "offer"))[: -grp.TAG_BYTES])
        intruder.set(f"{grp.PREFIX}{offer['session']}/join/2", b"x" * grp.TAG_BYTES)

    forger = threading.Thread(target=forge)
    forger.start()
    seconds, error = world.send(stream(), expect=ProtocolError)
    forger.join(BOUND_S)
    assert seconds < BOUND_S
    assert "receiver rank 2's join failed the secret check" in str(error) and "before any weight" in str(error)
    honest = world.receivers[1].result()
    assert honest[0] == "TransferError" and "ProtocolError" in honest[1] and honest[3] == {}
    world.fresh_session_lands()


def test_garbage_offer_in_the_store(world):
    """Garbage where the offer goes: receivers refuse it at once instead of joining or hanging."""
    store = dist.TCPStore("127.0.0.1", world.port, is_master=False, timeout=datetime.timedelta(seconds=5))
    store.set(grp.PREFIX + "offer", b"\xc1garbage" * 8)
    start = time.monotonic()
    world.start()
    for process in world.receivers.values():
        error, message, seconds, got, _ = process.result()
        assert error == "ProtocolError" and "failed the secret check" in message and got == {}
    assert time.monotonic() - start < BOUND_S
    store.delete_key(grp.PREFIX + "offer")
    world.fresh_session_lands()


HUGE_SPLIT = encode(
    "bucket",
    session="garbage0session",
    seq=0,
    half=0,
    wide=False,
    last=False,
    nbytes=256,
    entries=[["huge", "uint8", [1 << 60], 0, 0, 256]],  # the first piece of a 1 EiB tensor
)


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ([40, 0], ("undecodable frame", "frame is a msgpack")),  # 40 random bytes follow
        ([1 << 40, 0], ("header announces",)),
        ([40, 1 << 40], ("header announces",)),
        ([len(HUGE_SPLIT), 256], ("refusing to allocate",)),
    ],
    ids=["undecodable", "huge-meta", "huge-data", "huge-split"],
)
def test_garbage_on_the_metadata_channel(world, header, expected):
    """A group member (here a hand-made rank 0 holding the secret) broadcasts garbage metadata."""
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    secret = grp.checked_secret(SECRET)
    store = grp.connect_store("127.0.0.1", port, is_master=True, timeout_s=TIMEOUT_S)
    session, nonce = "garbage0session", b"n" * 16
    grp.put(
        store,
        "offer",
        grp.sign(
            secret,
            "offer",
            {
                "session": session,
                "version": 7,
                "world": 3,
                "half_bytes": 4096,
                "backend": "gloo",
                "nonce": nonce,
            },
        ),
    )
    start = time.monotonic()
    for rank, process in world.receivers.items():
        process.start(url, SECRET, rank, "ok", TIMEOUT_S)
    grp.wait_until(
        lambda: all(grp.has(store, f"{session}/join/{r}") for r in (1, 2)),
        deadline=time.monotonic() + BOUND_S,
        on_timeout=lambda: AssertionError("receivers did not join"),
    )
    grp.put(store, f"{session}/go", grp.sign(secret, "go", {"session": session, "group": session, "fresh": True}))
    group = grp.form_group(store, session, 0, 3, "gloo", TIMEOUT_S)
    works = [grp.broadcast(group, torch.tensor(header, dtype=torch.int64))]
    if header == [40, 0]:
        works.append(grp.broadcast(group, torch.randint(0, 256, (40,), dtype=torch.uint8)))
    if header[1] == 256:  # a well-formed frame whose split tensor could never be allocated
        works.append(grp.broadcast(group, torch.frombuffer(bytearray(HUGE_SPLIT), dtype=torch.uint8)))
        works.append(grp.broadcast(group, torch.zeros(256, dtype=torch.uint8)))
    for process in world.receivers.values():
        error, message, _, got, version = process.result()
        assert error == "ProtocolError", message
        assert any(text in message for text in expected), message
        assert got == {} and version == (None, None)
    assert time.monotonic() - start < BOUND_S
    holder, group, works = [group], None, None
    grp.close_group(holder, failed=True)
    world.fresh_session_lands()


def test_bad_arguments_are_refused_up_front():
    with pytest.raises(InvalidInput, match="secret must be bytes or str of at least 16 bytes"):
        BroadcastWeightReceiver("tcp://127.0.0.1:1", secret="short", rank=1)
    with pytest.raises(InvalidInput, match="rendezvous="):
        BroadcastWeightReceiver("127.0.0.1:29500", secret=SECRET, rank=1)
    with pytest.raises(InvalidInput, match="rank=0"):
        BroadcastWeightReceiver("tcp://127.0.0.1:1", secret=SECRET, rank=0)
    with pytest.raises(InvalidInput, match="backend='nccl' needs device='cuda'"):
        BroadcastWeightReceiver("tcp://127.0.0.1:1", secret=SECRET, rank=1, backend="nccl")
    assert WeightVersion().clean and not WeightVersion(3, 4).clean


@pytest.mark.parametrize("bucket_bytes", [2**62, (128 << 30) + 2])
def test_a_bucket_receivers_would_refuse_is_refused_by_the_sender_up_front(bucket_bytes):
    """Receivers allocate the whole bucket and refuse an offer of halves over 64 GiB: the constructor says so, naming
    the knob and the limit, before it hosts anything (no rendezvous is needed to refuse)."""
    with pytest.raises(InvalidInput) as raised:
        BroadcastWeightSender(f"tcp://127.0.0.1:{free_port()}", secret=SECRET, receivers=1, bucket_bytes=bucket_bytes)
    assert str(raised.value) == (
        f"bucket_bytes={bucket_bytes}; need an int of at least 1024 and at most 137438953472 (128 GiB: receivers "
        "allocate the whole bucket and refuse a larger one)"
    )


def test_bad_stream_is_refused_before_the_session(world):
    with pytest.raises(InvalidInput, match="version=-1"):
        world.sender.send(stream(), version=-1)
    with pytest.raises(InvalidInput, match="duplicate tensor name 's0'"):
        world.sender.send(stream() + [("s0", torch.zeros(1))], version=1)
    world.fresh_session_lands()


@pytest.mark.cuda
def test_gloo_with_cuda_tensors_on_both_sides():
    """One GPU: the gloo path with CUDA tensors on both sides (gloo stages them through the host)."""
    url = f"tcp://127.0.0.1:{free_port()}"
    sender = BroadcastWeightSender(url, secret=SECRET, receivers=1, bucket_bytes=BUCKET, device="cuda", timeout_s=30.0)
    process = ReceiverProcess()
    try:
        weights = [
            (f"{name}.w", random_tensor(dtype, (7, 13), seed).cuda())
            for seed, (name, dtype) in enumerate(SUPPORTED_DTYPES.items())
        ]
        weights += [
            ("wide", random_tensor(torch.float32, (48, 256), 90).cuda()),
            ("split", random_tensor(torch.bfloat16, (300, 257), 91).cuda()),
        ]
        want = {name: digest(tensor) for name, tensor in weights}
        for version, as_given in enumerate((weights, iter(weights)), 1):
            process.start(url, SECRET, 1, "ok", 30.0, "cuda")
            sender.send(as_given, version=version)
            error, message, _, got, landed = process.result()
            assert error is None, message
            assert got == want and landed == (version, None)
    finally:
        assert process.close() == 0
