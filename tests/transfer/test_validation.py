"""Bad items are caught one by one as the stream is consumed; the session aborts cleanly on both sides."""

from __future__ import annotations

import pytest
import torch

from refitkit.errors import InvalidInput
from refitkit.transfer import BucketedWeightSender
from tests.transfer.harness import own_segment_files, roundtrip
from tests.transfer.peers import mapped_segments

pytestmark = pytest.mark.timeout(60)

GOOD = ("ok.weight", torch.ones(4))


@pytest.mark.parametrize(
    "bad, match",
    [
        (("dup", torch.ones(2)), "duplicate tensor name 'dup'"),
        (("", torch.ones(2)), "non-empty str"),
        ((7, torch.ones(2)), "non-empty str, got 7"),
        (("not_a_tensor", [1.0, 2.0]), "'not_a_tensor' is a list, not a torch.Tensor"),
        (("quantized", torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)), "'quantized' has dtype torch.qint8"),
        (("sparse", torch.eye(3).to_sparse()), "'sparse' has layout"),
        (("meta", torch.empty(3, device="meta")), "'meta' is on device meta"),
        (torch.ones(2), "item #1 is a Tensor, not a \\(name, tensor\\) pair"),
        (("a", "b", "c"), "item #1 is a tuple"),
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


def test_non_iterable_weights(endpoint):
    with BucketedWeightSender(endpoint, timeout_s=1) as sender:
        with pytest.raises(InvalidInput, match="not an iterable"):
            sender.send(42)


def test_cuda_ipc_needs_cuda(endpoint):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only refusal")
    with pytest.raises(InvalidInput, match="cuda_ipc"):
        BucketedWeightSender(endpoint, transport="cuda_ipc")
