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
    return [
        (f"layers.{i}.w", torch.randn(256, 1024, generator=generator, device="cuda").to(torch.bfloat16))
        for i in range(count)
    ]


def _made(
    sources: list[tuple[str, torch.Tensor]], side: torch.cuda.Stream, plan: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Item i is made as ``plan[i]`` says: ``S`` on ``side`` behind a long kernel, yielded from inside that stream's
    context; ``s`` the same without the kernel; ``d`` on the default stream behind a long kernel; ``D`` on the
    default stream at once. Each is a fresh tensor: only the timing can go wrong."""
    for (name, tensor), how in zip(sources, plan):
        if how in "Ss":
            with torch.cuda.stream(side):
                if how == "S":
                    torch.cuda._sleep(SLEEP_CYCLES)
                made = tensor.clone()  # queued behind the sleep, on the side stream
                yield name, made
        else:
            if how == "d":
                torch.cuda._sleep(SLEEP_CYCLES)
            yield name, tensor.clone()


# Two items a bucket with 2 MiB: "SDD" buckets ship while the default stream is current although an item of theirs
# was copied on the side stream; "dds" buckets ship from inside the side stream, their items copied behind a kernel
# on the default stream (the default stream's handle is 0: it must be waited for as the default stream itself).
@pytest.mark.parametrize(
    ("plan", "bucket_bytes"),
    [("SSSS", 16 << 20), ("SDD" * 4, 2 << 20), ("dds" * 4, 2 << 20)],
    ids=[
        "all-on-a-side-stream-one-bucket",
        "side-stream-items-shipped-from-the-default-stream",
        "default-stream-items-shipped-from-a-side-stream",
    ],
)
def test_copies_queued_on_the_generators_stream_are_waited_for_before_the_bucket_is_announced(
    receiver_server, endpoint, plan, bucket_bytes
):
    sources = _sources(len(plan))
    expected = {name: digest(tensor) for name, tensor in sources}
    side = torch.cuda.Stream()
    roundtrip(
        receiver_server,
        endpoint,
        _made(sources, side, plan),
        bucket_bytes=bucket_bytes,
        case=CUDA_IPC,
        timeout_s=60,
        expected=expected,
    )
