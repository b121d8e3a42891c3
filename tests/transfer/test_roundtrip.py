"""Round trips through real processes: every tensor arrives bit-exact, in the buckets the layout promises."""

from __future__ import annotations

import asyncio

import pytest
import torch

from refitkit.transfer.protocol import ALIGN_BYTES, SUPPORTED_DTYPES
from tests.transfer.harness import roundtrip

pytestmark = pytest.mark.timeout(60)

HALF = 4096  # bucket_bytes=8192 -> two halves of 4096 bytes


def random_tensor(shape, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    """Random bit patterns of any dtype (bools as 0/1: other bytes are not valid bools)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool().to(device)
    itemsize = dtype.itemsize
    count = torch.Size(shape).numel()
    raw = torch.randint(0, 256, (count * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape).to(device)


def test_single_tensor(receiver_server, endpoint, case):
    weights = [("model.embed.weight", torch.randn(33, 17).to(case.tensor_device))]
    stats, result = roundtrip(receiver_server, endpoint, weights, case=case)
    assert (stats.buckets, stats.tensors) == (1, 1)
    assert result["calls"] == [(1, True)]


def test_transfer_stats_repr_shows_every_documented_figure_gbps_included(receiver_server, endpoint):
    stats, _ = roundtrip(receiver_server, endpoint, [("w", torch.randn(1 << 12))])
    assert stats.gbps > 0
    assert repr(stats) == (
        f"TransferStats(bytes={4 << 12}, tensors=1, buckets=1, seconds={stats.seconds!r}, ack_wait_s={stats.ack_wait_s!r}, "
        f"gbps={stats.gbps!r})"
    )


def test_many_tensors(receiver_server, endpoint, case):
    weights = [
        (f"layers.{i}.w", random_tensor((i % 7 + 1, 13), torch.bfloat16, case.tensor_device, i)) for i in range(300)
    ]
    stats, result = roundtrip(receiver_server, endpoint, weights, bucket_bytes=16 << 10, case=case)
    assert stats.buckets == len(result["calls"]) > 2
    assert sum(count for count, _ in result["calls"]) == 300
    assert [last for _, last in result["calls"]] == [False] * (stats.buckets - 1) + [True]


def test_exact_bucket_boundary(receiver_server, endpoint, case):
    # Four 2048-byte tensors fill two halves exactly: two buckets, no empty trailer.
    weights = [(f"w{i}", random_tensor((512,), torch.float32, case.tensor_device, i)) for i in range(4)]
    stats, result = roundtrip(receiver_server, endpoint, weights, bucket_bytes=2 * HALF, case=case)
    assert result["calls"] == [(2, False), (2, True)]
    assert stats.buckets == 2


def test_alignment_pushes_to_next_bucket(receiver_server, endpoint):
    # 4000 + 8 bytes would fit, but the second tensor starts at the next 256-byte boundary: a new bucket.
    # (A generator: a list would get a buffer sized to it, with other boundaries.)
    weights = [("a", random_tensor((4000,), torch.uint8)), ("b", random_tensor((8,), torch.uint8))]
    _, result = roundtrip(receiver_server, endpoint, weights, bucket_bytes=2 * HALF, generator=True)
    assert result["calls"] == [(1, False), (1, True)]
    assert 4000 + 8 <= HALF < ((4000 + ALIGN_BYTES - 1) // ALIGN_BYTES) * ALIGN_BYTES + 8


def test_tensor_larger_than_bucket_is_split_and_reassembled(receiver_server, endpoint, case):
    big = random_tensor((5 * HALF + 7,), torch.int8, case.tensor_device, 1)  # odd size: ranges end mid-element
    wide = random_tensor((3, HALF), torch.float16, case.tensor_device, 2)  # 24 KiB of 2-byte elements
    weights = [("small", random_tensor((10,), torch.float32, case.tensor_device, 3)), ("big", big), ("wide", wide)]
    stats, result = roundtrip(receiver_server, endpoint, weights, bucket_bytes=2 * HALF, case=case)
    assert stats.buckets >= (big.numel() + wide.numel() * 2) // HALF
    assert sum(count for count, _ in result["calls"]) == 3  # each split tensor delivered once, whole


def test_tensor_between_a_half_and_the_bucket_goes_whole_into_a_wide_bucket(receiver_server, endpoint, case):
    # A wide bucket spans both halves: its tensor arrives in one bucket (a view, not reassembled), and
    # small tensors that still fit follow it there. Only tensors larger than the whole bucket are split.
    def make(shape, seed):
        return random_tensor(shape, torch.float32, case.tensor_device, seed)

    weights = [
        ("full", make((HALF // 4,), 1)),  # fills half 0 exactly
        ("empty", make((0, 3), 2)),  # zero bytes at the very end of a full half
        ("wide", make((1500,), 3)),  # 6000 bytes: more than a half, less than the bucket
        ("small", make((3,), 4)),  # fits behind it in the same wide bucket
        ("wide_exact", make((2 * HALF // 4,), 5)),  # exactly the whole bucket
        ("empty_at_end", make((0,), 6)),
        ("huge", make((5000,), 7)),  # 20000 bytes: split over five halves
        ("wide_strided", make((40, 30), 8).t()),
    ]
    for mode in ("collect", "iter"):
        stats, result = roundtrip(
            receiver_server, endpoint + mode, weights, bucket_bytes=2 * HALF, case=case, mode=mode
        )
        if mode == "collect":
            assert result["calls"] == [(2, False), (2, False), (2, False)] + [(0, False)] * 4 + [(1, False), (1, True)]
        assert stats.buckets == 9


def test_empty_iterable(receiver_server, endpoint, case):
    stats, result = roundtrip(receiver_server, endpoint, [], case=case)
    assert result["calls"] == [(0, True)]  # the loader still learns the stream ended
    assert (stats.tensors, stats.bytes) == (0, 0)


@pytest.mark.parametrize("dtype", sorted(SUPPORTED_DTYPES.values(), key=str), ids=str)
def test_every_dtype(receiver_server, endpoint, dtype):
    weights = [
        ("scalar", random_tensor((), dtype, seed=1)),
        ("matrix", random_tensor((9, 11), dtype, seed=2)),
        ("empty", random_tensor((0, 4), dtype)),
        ("split", random_tensor((HALF + 3,), dtype, seed=3)),
    ]
    roundtrip(receiver_server, endpoint, weights, bucket_bytes=2 * HALF)


def test_strided_tensors(receiver_server, endpoint, case):
    base = random_tensor((64, 48), torch.float32, case.tensor_device, 5)
    weights = [
        ("transposed", base.t()),
        ("stepped", base[::3, 1::2]),
        ("expanded", base[0:1, :].expand(40, 48)),  # stride 0
        ("big_strided", random_tensor((3 * HALF, 2), torch.float32, case.tensor_device, 6).t()),  # split too
    ]
    roundtrip(receiver_server, endpoint, weights, bucket_bytes=2 * HALF, case=case)


def test_async_iterable_via_send_and_asend(receiver_server, endpoint, case):
    weights = [(f"w{i}", random_tensor((300,), torch.float32, case.tensor_device, i)) for i in range(20)]

    async def agen():
        for item in weights:
            await asyncio.sleep(0)
            yield item

    roundtrip(receiver_server, endpoint, agen(), case=case, expected=_digests(weights))

    class Wrapped:  # send() of an async iterable inside a running loop must point to asend()
        def __aiter__(self):
            return agen()

    async def inside_loop():
        from refitkit.errors import InvalidInput
        from refitkit.transfer import BucketedWeightSender

        with BucketedWeightSender(endpoint + "x", timeout_s=1) as sender:
            with pytest.raises(InvalidInput, match="asend"):
                sender.send(Wrapped())
            return await _asend(sender)

    async def _asend(sender):
        receiver_server.start_session(endpoint + "x", device=case.receiver_device, timeout_s=10)
        return await sender.asend(agen())

    asyncio.run(inside_loop())
    result = receiver_server.result()
    assert result["ok"] and result["digests"] == _digests(weights)


def test_iter_weights(receiver_server, endpoint, case):
    weights = [(f"w{i}", random_tensor((700,), torch.float32, case.tensor_device, i)) for i in range(12)]
    weights.append(("big", random_tensor((3 * HALF,), torch.float32, case.tensor_device, 99)))
    stats, result = roundtrip(receiver_server, endpoint, weights, bucket_bytes=2 * HALF, case=case, mode="iter")
    assert result["stats"].tensors == 13 and result["stats"].buckets == stats.buckets


def test_sessions_repeat_on_one_sender(receiver_server, endpoint):
    from refitkit.transfer import BucketedWeightSender

    with BucketedWeightSender(endpoint, bucket_bytes=2 * HALF, timeout_s=10) as sender:
        for round_index in range(5):
            weights = [(f"w{i}", random_tensor((400,), torch.float32, seed=round_index * 10 + i)) for i in range(6)]
            receiver_server.start_session(endpoint, timeout_s=10)
            stats = sender.send(weights)
            result = receiver_server.result()
            assert result["ok"] and result["digests"] == _digests(weights)
            assert stats.buckets == 3 and stats.ack_wait_s <= stats.seconds


def _digests(weights):
    from tests.transfer.peers import digest

    return {name: digest(tensor) for name, tensor in weights}
