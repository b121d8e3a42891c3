"""One round trip through a real sender (this process) and a real receiver (spawned process)."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from refitkit.transfer import BucketedWeightSender, TransferStats
from tests.transfer.peers import ReceiverServer, digest, mapped_segments


@dataclass(frozen=True)
class Case:
    transport: str
    tensor_device: str
    receiver_device: str

    def __str__(self) -> str:
        return f"{self.transport}-{self.tensor_device}-to-{self.receiver_device}"


CASES = [
    pytest.param(Case("shm", "cpu", "cpu"), id="shm-cpu"),
    pytest.param(Case("cuda_ipc", "cuda", "cuda"), id="cuda_ipc", marks=pytest.mark.cuda),
    pytest.param(Case("shm", "cuda", "cuda"), id="shm-cuda", marks=pytest.mark.cuda),
]


def own_segment_files() -> list[str]:
    """This process's shared-memory segments: named files, and memfds it still holds a descriptor of
    (a finished send leaves none)."""
    named = glob.glob(f"/dev/shm/refitkit-{os.getuid()}-{os.getpid()}-*")
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own descriptor, closed by now
        if target.startswith("/memfd:refitkit-"):
            held.append(target)
    return named + held


def roundtrip(
    server: ReceiverServer,
    endpoint: str,
    weights: Any,
    *,
    bucket_bytes: int = 64 << 10,
    case: Case = Case("shm", "cpu", "cpu"),
    mode: str = "collect",
    timeout_s: float = 10.0,
    expected: dict[str, Any] | None = None,
    generator: bool = False,
) -> tuple[TransferStats, dict[str, Any]]:
    """Send ``weights`` and check the receiver got every tensor bit-exactly and both sides released.

    ``generator``: send them as a generator (a list is sent as is: its buffer is sized to it, and its
    small tensors are batched; a generator gets halves of exactly ``bucket_bytes // 2``)."""
    if expected is None:
        expected = {name: digest(tensor) for name, tensor in weights}
    with BucketedWeightSender(endpoint, bucket_bytes=bucket_bytes, transport=case.transport, timeout_s=timeout_s) as sender:
        server.start_session(endpoint, device=case.receiver_device, timeout_s=timeout_s, mode=mode)
        stats = sender.send((item for item in weights) if generator else weights)
        assert own_segment_files() == [] and mapped_segments() == []  # sender holds no bucket memory
    result = server.result()
    assert result["ok"], result
    assert result["digests"] == expected
    assert result["segments_after"] == []  # receiver unmapped before it returned
    assert stats.tensors == len(expected)
    assert stats.bytes == sum(torch.Size(shape).numel() * torch.empty(0, dtype=getattr(torch, dtype[6:])).element_size()
                              for dtype, shape, _ in expected.values())  # fmt: skip
    return stats, result

