"""refitkit: colocated RL refit — weights to the inference engine, trainer state to pinned host memory.

``import refitkit`` needs torch alone; engines, transfer and watchdog live in subpackages.
"""

from refitkit.errors import (
    BarrierTimeout,
    EngineAsleep,
    EngineError,
    EngineTimeout,
    InvalidInput,
    KVCacheWontFit,
    LeakDetected,
    LinkClosed,
    OffloadedStateError,
    PartialPush,
    ProtocolError,
    RankFailure,
    RecoveryNeeded,
    RefitError,
    TransferError,
    TransferTimeout,
)
from refitkit.offload import HostArena, MoveStats, flush_device, offload_tensors, reload_tensors
from refitkit.refit import RefitCycle

__version__ = "0.1.0"

__all__ = [
    "BarrierTimeout",
    "EngineAsleep",
    "EngineError",
    "EngineTimeout",
    "HostArena",
    "InvalidInput",
    "KVCacheWontFit",
    "LeakDetected",
    "LinkClosed",
    "MoveStats",
    "OffloadedStateError",
    "PartialPush",
    "ProtocolError",
    "RankFailure",
    "RecoveryNeeded",
    "RefitCycle",
    "RefitError",
    "TransferError",
    "TransferTimeout",
    "flush_device",
    "offload_tensors",
    "reload_tensors",
]
