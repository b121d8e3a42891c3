"""Checking each streamed (name, tensor) and laying tensors out in bucket halves.

The sender validates every item just before packing it (the stream is consumed once). Small
tensors go whole into the current half, or start a new one; a tensor larger than a half is
split into byte ranges that fill halves one after another.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from refitkit.errors import InvalidInput
from refitkit.transfer.protocol import SUPPORTED_DTYPES, Entry, align_up, dtype_name


def check_item(index: int, item: Any, seen: set[str], *, need_cuda: bool) -> tuple[str, torch.Tensor]:
    """One streamed item as (name, detached tensor), or InvalidInput naming what is wrong with it."""
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise InvalidInput(f"weights item #{index} is a {type(item).__name__}, not a (name, tensor) pair")
    name, tensor = item
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"weights item #{index}: the name must be a non-empty str, got {name!r}")
    if not isinstance(tensor, torch.Tensor):
        raise InvalidInput(f"{name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    dtensor_module = sys.modules.get("torch.distributed.tensor")  # no DTensor exists unless it was imported
    if dtensor_module is not None and isinstance(tensor, dtensor_module.DTensor):
        raise InvalidInput(f"{name!r} is a DTensor shard; send full tensors (adapter.named_weights() gathers them)")
    if tensor.layout != torch.strided:
        raise InvalidInput(f"{name!r} has layout {tensor.layout}; only dense (strided) tensors can be sent")
    if tensor.device.type not in ("cpu", "cuda"):
        raise InvalidInput(f"{name!r} is on device {tensor.device}; only cpu and cuda tensors can be sent")
    if dtype_name(tensor.dtype) is None:
        raise InvalidInput(
            f"{name!r} has dtype {tensor.dtype}, which cannot be sent; supported: {', '.join(sorted(SUPPORTED_DTYPES))}"
        )
    if name in seen:
        raise InvalidInput(f"duplicate tensor name {name!r} in one send()")
    if need_cuda and not tensor.is_cuda:
        raise InvalidInput(f"{name!r} is on {tensor.device}; transport='cuda_ipc' needs CUDA tensors")
    seen.add(name)
    return name, tensor.detach()


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class BucketPacker:
    """Copies tensors into the two halves of a bucket buffer; calls ``flush`` when a half is full."""

    def __init__(self, buffer: torch.Tensor, half_bytes: int, flush: Callable[[bool], None]) -> None:
        self._buffer = buffer
        self.half_bytes = half_bytes
        self._flush = flush
        self.half = 0
        self.used = 0
        self.entries: list[Entry] = []

    def detach(self) -> None:
        """Forget the buffer, so it can be freed even while this packer is still referenced."""
        self._buffer = None  # type: ignore[assignment]

    def next_half(self) -> None:
        """Start packing the other half (the caller waited until the receiver was done with it)."""
        self.half ^= 1
        self.used = 0
        self.entries = []

    def _region(self, offset: int, nbytes: int) -> torch.Tensor:
        base = self.half * self.half_bytes + offset
        return self._buffer[base : base + nbytes]

    def pack(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one tensor in, whole when it fits in a half, else as byte ranges over several halves."""
        nbytes = tensor_nbytes(tensor)
        if nbytes <= self.half_bytes:
            offset = align_up(self.used)
            if offset + nbytes > self.half_bytes:
                self._flush(False)
                offset = 0
            self._region(offset, nbytes).view(tensor.dtype).view(tensor.shape).copy_(tensor)
            self._add(Entry(name, dtype_name(tensor.dtype), tuple(tensor.shape), offset, nbytes, 0, nbytes), offset)
            return
        # Larger than a half: one contiguous byte view (a temporary copy only if the tensor is strided).
        flat = tensor.contiguous().reshape(-1).view(torch.uint8)
        start = 0
        while start < nbytes:
            offset = align_up(self.used)
            if offset >= self.half_bytes:
                self._flush(False)
                offset = 0
            count = min(self.half_bytes - offset, nbytes - start)
            self._region(offset, count).copy_(flat[start : start + count])
            self._add(Entry(name, dtype_name(tensor.dtype), tuple(tensor.shape), offset, count, start, nbytes), offset)
            start += count

    def _add(self, entry: Entry, offset: int) -> None:
        self.entries.append(entry)
        self.used = offset + entry.nbytes
