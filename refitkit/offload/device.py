"""Device-level helpers: the one explicit sync point of a phase, and storage views."""

from __future__ import annotations

import torch


def flush_device(device: torch.device | str | int | None = None) -> None:
    """Wait for the device's queued work, then return its cached free blocks to the driver.

    This is the explicit replacement for the accidental sync that a full garbage collection gives peers:
    ``synchronize()`` then ``empty_cache()``. A no-op without CUDA.
    """
    if not torch.cuda.is_available():
        return
    if device is not None:
        device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if device.type != "cuda":
            return
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def synchronize(device: torch.device) -> None:
    """One synchronize for a phase's queued copies (CPU copies are already complete)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resolved_device(device: torch.device) -> torch.device:
    """``device`` with its index: ``cuda`` alone means the current CUDA device (a tensor on it says ``cuda:0``)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def storage_as_bytes(storage: torch.UntypedStorage, nbytes: int | None = None) -> torch.Tensor:
    """A flat uint8 tensor over ``storage`` (no copy), for byte-exact moves of any dtype."""
    size = storage.nbytes() if nbytes is None else nbytes
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    flat.set_(storage, 0, (size,), (1,))
    return flat


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that owns real storage: a DTensor's local shard, otherwise the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    if to_local is not None and type(tensor).__name__ == "DTensor":
        with torch.no_grad():
            return to_local()
    return tensor
