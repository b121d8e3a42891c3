"""Engine-agnostic moving of training state between the device and pinned host memory.

The only place in refitkit that copies training state. Moves go per unique storage and keep
tensor identity; see ``HostArena`` for how host memory is held.
"""

from refitkit.errors import ReserveTimeout
from refitkit.offload.arena import HostArena, Reservation
from refitkit.offload.device import flush_device
from refitkit.offload.moves import drop_tensors, named_tensors, offload_tensors, regrow_tensors, reload_tensors
from refitkit.offload.optimizer import (
    offload_grads,
    offload_optimizer,
    optimizer_state_tensors,
    reload_grads,
    reload_optimizer,
)
from refitkit.offload.stats import MoveStats

__all__ = [
    "HostArena",
    "MoveStats",
    "Reservation",
    "ReserveTimeout",
    "drop_tensors",
    "flush_device",
    "named_tensors",
    "offload_grads",
    "offload_optimizer",
    "offload_tensors",
    "optimizer_state_tensors",
    "reload_grads",
    "reload_optimizer",
    "regrow_tensors",
    "reload_tensors",
]
