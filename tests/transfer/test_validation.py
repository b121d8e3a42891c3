"""Bad input is refused with InvalidInput naming it: a list or tuple before any receiver sees a byte, a
generator item by item (the receiver then learns its weights are incomplete), knobs in the constructors."""

from __future__ import annotations

import re
import time
import warnings

import pytest
import torch

from refitkit.errors import InvalidInput
from refitkit.transfer import BucketedWeightReceiver, BucketedWeightSender
from refitkit.transfer.common import MAX_TIMEOUT_S
from tests.transfer.harness import own_segment_files, roundtrip
from tests.transfer.peers import mapped_segments

pytestmark = pytest.mark.timeout(60)

GOOD = ("ok.weight", torch.ones(4))
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # strided nested tensors are a prototype API; they must still be refused
    NESTED = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
JAGGED = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
INCOMPLETE = re.compile(r"INCOMPLETE: (\d+) buckets \((\d+) tensors\) were already handed to on_bucket")


def hello_is_queued(sender: BucketedWeightSender) -> None:
    """Wait (bounded) until a receiver's hello sits on the sender's socket, so the test knows one is waiting."""
    assert sender._socket is not None and sender._socket.poll(30_000), "the receiver's hello never arrived"


@pytest.mark.parametrize(
    "bad, match",
    [
        (("dup", torch.ones(2)), "duplicate tensor name 'dup'"),
        (("", torch.ones(2)), "non-empty str"),
        ((7, torch.ones(2)), "non-empty str, got 7"),
        (("not_a_tensor", [1.0, 2.0]), "'not_a_tensor' is a list, not a torch.Tensor"),
        (
            ("quantized", torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)),
            "'quantized' has dtype torch.qint8",
        ),
        (("sparse", torch.eye(3).to_sparse()), "'sparse' has layout"),
        (("meta", torch.empty(3, device="meta")), "'meta' is on device meta"),
        (torch.ones(2), "item #1 is a Tensor, not a \\(name, tensor\\) pair"),
        (("a", "b", "c"), "item #1 is a tuple"),
        (("nested", NESTED), "'nested' is a nested tensor"),
        (("jagged", JAGGED), "'jagged' is a nested tensor"),
        (("w\ud800", torch.ones(2)), "the name 'w\\\\ud800' is not valid UTF-8"),
    ],
)
def test_bad_item_aborts_the_session_and_names_the_tensor(receiver_server, endpoint, bad, match):
    items = [("dup", torch.ones(2)), bad] if match.startswith("duplicate") else [GOOD, bad]
    with BucketedWeightSender(endpoint, bucket_bytes=8192, timeout_s=5) as sender:
        receiver_server.start_session(endpoint, timeout_s=5)
        with pytest.raises(InvalidInput, match=match):
            sender.send(iter(items))
        assert own_segment_files() == [] and mapped_segments() == []
    result = receiver_server.result()
    assert not result["ok"] and result["type"] == "TransferError" and "aborted" in result["message"]
    assert result["segments_after"] == []
    roundtrip(receiver_server, endpoint, [GOOD])  # a fresh session on the same endpoint works


def test_failure_mid_stream_never_reports_a_last_bucket(receiver_server, endpoint):
    """Earlier buckets were delivered; the receiver never sees is_last=True, so a loader commits nothing."""

    def stream():
        for index in range(10):
            yield f"w{index}", torch.full((1000,), float(index))  # 4000 bytes: one per 4096-byte half
        yield "w3", torch.ones(1)

    with BucketedWeightSender(endpoint, bucket_bytes=8192, timeout_s=5) as sender:
        receiver_server.start_session(endpoint, timeout_s=5, mode="collect")
        with pytest.raises(InvalidInput, match="duplicate tensor name 'w3'"):
            sender.send(stream())
    result = receiver_server.result()
    assert not result["ok"] and "aborted the session at bucket" in result["message"]
    # Buckets already handed over were applied: the receiver's error says so, with the counts.
    counts = INCOMPLETE.search(result["message"])
    assert counts is not None, result["message"]
    assert 1 <= int(counts[1]) == int(counts[2]) <= 10  # one 4000-byte tensor per bucket
    roundtrip(receiver_server, endpoint, [GOOD])


def test_caller_iterator_exception_aborts_too(receiver_server, endpoint):
    def stream():
        yield GOOD
        raise KeyError("gather failed on rank 3")

    with BucketedWeightSender(endpoint, bucket_bytes=8192, timeout_s=5) as sender:
        receiver_server.start_session(endpoint, timeout_s=5)
        with pytest.raises(KeyError, match="rank 3"):
            sender.send(stream())
    result = receiver_server.result()
    assert not result["ok"] and "rank 3" in result["message"]


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_interrupt_from_the_iterator_aborts_the_receiver_at_once(receiver_server, endpoint, interrupt):
    def stream():
        for index in range(4):
            yield f"w{index}", torch.full((1000,), float(index))
        raise interrupt("the trainer is stopping")

    with BucketedWeightSender(endpoint, bucket_bytes=8192, timeout_s=20) as sender:
        receiver_server.start_session(endpoint, timeout_s=20)
        with pytest.raises(interrupt):
            sender.send(stream())
        assert own_segment_files() == [] and mapped_segments() == []
    result = receiver_server.result()
    assert not result["ok"] and result["type"] == "TransferError" and interrupt.__name__ in result["message"]
    assert INCOMPLETE.search(result["message"]), result["message"]
    assert result["seconds"] < 10  # told at once, not after its timeout_s=20
    roundtrip(receiver_server, endpoint, [GOOD])


@pytest.mark.parametrize("container", [list, tuple])
def test_a_bad_list_is_refused_whole_before_any_receiver_sees_a_byte(receiver_server, endpoint, container):
    """200 items whose last repeats a name: nothing is delivered, a waiting receiver is refused at once."""
    items = container(
        [(f"w{index}", torch.full((1000,), float(index))) for index in range(199)] + [("w3", torch.ones(1))]
    )
    with BucketedWeightSender(endpoint, bucket_bytes=8192, timeout_s=20) as sender:
        receiver_server.start_session(endpoint, timeout_s=20)
        hello_is_queued(sender)
        began = time.monotonic()
        with pytest.raises(InvalidInput, match=r"duplicate tensor name 'w3'"):
            sender.send(items)
        assert time.monotonic() - began < 2.0
        assert own_segment_files() == [] and mapped_segments() == []
    result = receiver_server.result()
    assert not result["ok"] and "refused the session" in result["message"] and "'w3'" in result["message"]
    assert result["seconds"] < 10  # refused, not timed out (timeout_s=20)
    roundtrip(receiver_server, endpoint, [GOOD])


@pytest.mark.parametrize(
    "bad, match",
    [
        (("nested", NESTED), "'nested' is a nested tensor"),
        (("w\ud800", torch.ones(2)), "not valid UTF-8"),
        (("meta", torch.empty(3, device="meta")), "'meta' is on device meta"),
        (torch.ones(2), "item #1 is a Tensor"),
    ],
)
def test_a_bad_list_without_a_receiver_is_invalid_input_at_once(endpoint, bad, match):
    with BucketedWeightSender(endpoint, bucket_bytes=8192, timeout_s=20) as sender:
        began = time.monotonic()
        with pytest.raises(InvalidInput, match=match):
            sender.send([GOOD, bad])
        assert time.monotonic() - began < 2.0  # not the timeout_s=20 wait for a hello


def test_send_none_refuses_a_waiting_receiver_at_once(receiver_server, endpoint):
    with BucketedWeightSender(endpoint, bucket_bytes=8192, timeout_s=20) as sender:
        receiver_server.start_session(endpoint, timeout_s=20)
        hello_is_queued(sender)
        with pytest.raises(InvalidInput, match="weights is a NoneType, not an iterable"):
            sender.send(None)
    result = receiver_server.result()
    assert not result["ok"] and "refused the session" in result["message"] and "NoneType" in result["message"]
    assert result["seconds"] < 10
    roundtrip(receiver_server, endpoint, [GOOD])


@pytest.mark.parametrize(
    "timeout_s, match",
    [
        (float("inf"), "timeout_s=inf; need a finite number"),
        (1e7, "at most MAX_TIMEOUT_S=604800"),
        (float("nan"), "timeout_s=nan"),
        (0, "above 0"),
        (-1.0, "above 0"),
        ("5", "timeout_s='5' is a str; need a number of seconds"),
        (True, "timeout_s=True is a bool"),
        (None, "timeout_s=None is a NoneType"),
    ],
)
def test_bad_timeout_is_refused_by_both_ends(endpoint, timeout_s, match):
    with pytest.raises(InvalidInput, match=match):
        BucketedWeightSender(endpoint, timeout_s=timeout_s)
    with pytest.raises(InvalidInput, match=match):
        BucketedWeightReceiver(endpoint, "cpu", timeout_s=timeout_s)


@pytest.mark.parametrize(
    "knobs, match",
    [
        ({"bucket_bytes": True}, "bucket_bytes=True; need an int of at least 1024"),
        ({"bucket_bytes": 4096.0}, "bucket_bytes=4096.0"),
        ({"bucket_bytes": "2G"}, "bucket_bytes='2G'"),
        ({"bucket_bytes": 512}, "at least 1024"),
        ({"transport": "tcp"}, "transport='tcp'; expected one of"),
        ({"transport": None}, "transport=None"),
        ({"bucket_bytes": None}, "bucket_bytes=None"),
        # more than any transport maps as one bucket: send() used to raise a raw OSError from mmap
        (
            {"bucket_bytes": 2**62},
            r"bucket_bytes=4611686018427387904; need an int of at least 1024 and at most "
            r"1099511627776 \(1 TiB, the most a transport maps or allocates as one bucket",
        ),
        ({"bucket_bytes": (1 << 40) + 1}, r"bucket_bytes=1099511627777; .* at most 1099511627776"),
    ],
)
def test_bad_sender_knobs(endpoint, knobs, match):
    with pytest.raises(InvalidInput, match=match):
        BucketedWeightSender(endpoint, **knobs)


def test_the_longest_timeout_works_on_both_ends(receiver_server, endpoint):
    """MAX_TIMEOUT_S fits every wait on both sides (a ZMQ poll takes an int of milliseconds)."""
    roundtrip(receiver_server, endpoint, [GOOD, ("b", torch.arange(5000))], bucket_bytes=8192, timeout_s=MAX_TIMEOUT_S)


def test_receiver_device_is_checked(endpoint):
    with pytest.raises(InvalidInput, match="device='tpu:0'"):
        BucketedWeightReceiver(endpoint, "tpu:0")
    with pytest.raises(InvalidInput, match="device='nowhere' is not a device"):
        BucketedWeightReceiver(endpoint, "nowhere")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidInput, match="device='cuda', but this process sees no CUDA device"):
            BucketedWeightReceiver(endpoint, "cuda")


def test_non_iterable_weights(endpoint):
    with BucketedWeightSender(endpoint, timeout_s=1) as sender:
        with pytest.raises(InvalidInput, match="not an iterable"):
            sender.send(42)


def test_cuda_ipc_needs_cuda(endpoint):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only refusal")
    with pytest.raises(InvalidInput, match="cuda_ipc"):
        BucketedWeightSender(endpoint, transport="cuda_ipc")


def test_on_hello_runs_once_after_the_receivers_hello_and_the_setup_before_the_second_item_is_pulled(
    receiver_server, endpoint
):
    events = []

    def stream():
        events.append("first item pulled")
        yield GOOD
        events.append("second item pulled")
        yield "second", torch.ones(4)

    with BucketedWeightSender(endpoint, bucket_bytes=8192, timeout_s=5) as sender:
        receiver_server.start_session(endpoint, timeout_s=5)
        stats = sender.send(stream(), on_hello=lambda: events.append("hello"))
    assert receiver_server.result()["ok"] and stats.tensors == 2
    assert events == ["first item pulled", "hello", "second item pulled"]


def test_an_on_hello_that_raises_fails_the_session_and_the_receiver_hears_why(receiver_server, endpoint):
    def refuse() -> None:
        raise RuntimeError("the engine's next call could not be queued")

    with BucketedWeightSender(endpoint, bucket_bytes=8192, timeout_s=5) as sender:
        receiver_server.start_session(endpoint, timeout_s=5)
        with pytest.raises(RuntimeError, match="could not be queued"):
            sender.send([GOOD], on_hello=refuse)
        result = receiver_server.result()
        assert not result["ok"] and "could not be queued" in result["message"], result
        with pytest.raises(InvalidInput, match=r"on_hello='soon'; need a callable"):
            sender.send([GOOD], on_hello="soon")
        receiver_server.start_session(endpoint, timeout_s=5)
        assert sender.send([GOOD]).tensors == 1  # the sender goes on
        assert receiver_server.result()["ok"]
