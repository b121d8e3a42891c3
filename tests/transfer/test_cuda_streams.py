"""GPU only (marker ``cuda``): a generator that yields from inside ``torch.cuda.stream(side)`` has its tensors copied
into the bucket on that side stream (torch's current stream at the time); the bucket is announced only once those
copies ran, also when it ships after the generator left the side stream (its last bucket) or when its items
alternate between streams. Each item is made behind a long kernel on its stream, so an early announcement would
hand the receiver bytes not yet written."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.transfer.harness import Case, roundtrip
from tests.transfer.peers import digest

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(180)]

CUDA_IPC = Case("cuda_ipc", "cuda", "cuda")
SLEEP_CYCLES = 200_000_000  # ~0.1 s of a spinning kernel on the H200: far longer than a bucket's hand-off


def _sources(count: int) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    return [(f"layers.{i}.w", torch.randn(256, 1024, generator=generator, device="cuda").to(torch.bfloat16)) for i in range(count)]


def _made_on_side_streams(sources: list[tuple[str, torch.Tensor]], side: torch.cuda.Stream, every: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Each ``every``-th item is made on ``side`` behind a long kernel and yielded from inside that stream's context
    (every=1: all of them); the others on the default stream. Each is a fresh tensor: only the timing can go wrong.

    With two items a bucket and every=3, buckets ship while the default stream is current although an item of theirs
    was copied on the side stream (items 0 and 3 of buckets [0, 1] and [2, 3]): their announcement must wait for it."""
    for index, (name, tensor) in enumerate(sources):
        if index % every == 0:
            with torch.cuda.stream(side):
                torch.cuda._sleep(SLEEP_CYCLES)
                made = tensor.clone()  # queued behind the sleep, on the side stream
                yield name, made
        else:
            yield name, tensor.clone()


@pytest.mark.parametrize(
    ("count", "every", "bucket_bytes"),
    [(4, 1, 16 << 20), (12, 3, 2 << 20)],
    ids=["all-on-a-side-stream-one-bucket", "alternating-streams-many-buckets"],
)
def test_copies_queued_on_the_generators_stream_are_waited_for_before_the_bucket_is_announced(
    receiver_server, endpoint, count, every, bucket_bytes
):
    sources = _sources(count)
    expected = {name: digest(tensor) for name, tensor in sources}
    side = torch.cuda.Stream()
    roundtrip(receiver_server, endpoint, _made_on_side_streams(sources, side, every), bucket_bytes=bucket_bytes,
              case=CUDA_IPC, timeout_s=60, expected=expected)  # fmt: skip
