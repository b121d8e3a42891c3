"""refitkit: colocated RL refit — weights to the inference engine, trainer state to pinned host memory.

``import refitkit`` needs torch alone; engines, transfer and watchdog live in subpackages.
"""

from refitkit.errors import (
    BarrierTimeout,
    InvalidInput,
    LeakDetected,
    ProtocolError,
    RefitError,
    TransferError,
    TransferTimeout,
)
from refitkit.offload import HostArena, MoveStats, flush_device, offload_tensors, reload_tensors

__version__ = "0.1.0"

__all__ = [
    "BarrierTimeout",
    "HostArena",
    "InvalidInput",
    "LeakDetected",
    "MoveStats",
    "ProtocolError",
    "RefitError",
    "TransferError",
    "TransferTimeout",
    "flush_device",
    "offload_tensors",
    "reload_tensors",
]
