"""What a move's copies write, in the order they are issued (a dispatch mode: real copies, only watched)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CopyOrder(TorchDispatchMode):
    """The storages (keys) that ``copy_`` writes, in the order the copies are issued."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.written.append(args[0].untyped_storage()._cdata)
        return func(*args, **(kwargs or {}))
