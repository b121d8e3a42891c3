"""The adapter's state and report types: where each part lives, and the bytes it moved or holds."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from refitkit.offload import MoveStats
from refitkit.offload.device import local_tensor

NamedTensors = list[tuple[str, torch.Tensor]]

PARTS: tuple[str, ...] = ("model", "optimizer", "grad")


class DeviceState(enum.Enum):
    """Where a part of the training state lives: on its accelerator, or in the host arena.

    ARRIVING: reloaded with ``defer_optimizer=True`` and still being copied back behind the caller;
    the optimizer's step (or the adapter's next offload / reload, or ``wait_deferred()``) waits for it.
    """

    ON_DEVICE = "on_device"
    OFFLOADED = "offloaded"
    ARRIVING = "arriving"


@dataclass(frozen=True)
class PartStates:
    """The state of each part: model (params + buffers), optimizer state, and grads."""

    model: DeviceState
    optimizer: DeviceState
    grad: DeviceState


@dataclass(frozen=True)
class PartBytes:
    """One part's bytes: resident on the device now, and held in the host arena now."""

    device_bytes: int
    host_bytes: int


@dataclass(frozen=True)
class StateBytes:
    """What ``state_bytes()`` reports: per-part bytes and the arena's allocated host bytes."""

    model: PartBytes
    optimizer: PartBytes
    grad: PartBytes
    arena_bytes: int

    @property
    def device_bytes(self) -> int:
        return self.model.device_bytes + self.optimizer.device_bytes + self.grad.device_bytes

    @property
    def host_bytes(self) -> int:
        return self.model.host_bytes + self.optimizer.host_bytes + self.grad.host_bytes


@dataclass(frozen=True)
class AdapterMove:
    """What one ``offload()`` / ``reload()`` call moved, per part and in total."""

    model: MoveStats
    optimizer: MoveStats
    grad: MoveStats
    total: MoveStats


def unique_storages(named: NamedTensors) -> Iterator[torch.UntypedStorage]:
    """Each storage behind ``named`` once (views and shards share storages)."""
    seen: set[int] = set()
    for _, tensor in named:
        storage = local_tensor(tensor).untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            yield storage


def empty_move() -> AdapterMove:
    """The report of a call that had nothing to move."""
    empty = MoveStats(bytes=0, storages=0, seconds=0.0)
    return AdapterMove(model=empty, optimizer=empty, grad=empty, total=empty)
