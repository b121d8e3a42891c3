"""Bit-level tensor comparison for tests: equal bytes, not equal values (NaN payloads, -0.0 count)."""

from __future__ import annotations

import torch

from refitkit.offload.device import local_tensor


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (DTensors compare their local shards)."""
    a, b = local_tensor(a), local_tensor(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return a.numel() == 0 or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
