"""Engine adapters: one per training engine, each only enumerating that engine's tensors.

The adapters live in subpackages (``refitkit.engines.fsdp``, ``.torchtitan``, ...) and import
their engine lazily, so ``import refitkit.engines`` needs torch alone.
"""

from refitkit.engines.base import (
    AdapterMove,
    DeviceState,
    EngineAdapter,
    FreshWeights,
    HeldWeights,
    PartBytes,
    PartStates,
    StateBytes,
)

__all__ = [
    "AdapterMove",
    "DeviceState",
    "EngineAdapter",
    "FreshWeights",
    "HeldWeights",
    "PartBytes",
    "PartStates",
    "StateBytes",
]
