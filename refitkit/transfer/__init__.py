"""Weight transfer from the trainer to the inference engine, in two wings.

- One host (``_ipc``): ``BucketedWeightSender`` binds an endpoint and streams (name, tensor) pairs
  through a double-buffered bucket in CUDA IPC or shared memory, with ZMQ control frames;
  ``BucketedWeightReceiver`` connects, maps the bucket once per session and hands the tensors to a
  loader. ``_ipc/sender.py`` and ``_ipc/receiver.py`` hold the session rules.
- Other GPUs or nodes (``_broadcast``): ``BroadcastWeightSender`` / ``BroadcastWeightReceiver`` carry
  the same streams over a torch.distributed broadcast (gloo or NCCL), a group formed per session
  through a TCPStore rendezvous and admitted by a per-job secret. ``_broadcast/sender.py`` holds the
  session and the security model.

Both share ``protocol`` (the wire format), ``packing`` (checking items, laying out buckets) and
``common`` (session phases, ``TransferStats``, ``WeightVersion``, the knob checks).
"""

from refitkit.transfer._broadcast.receiver import BroadcastWeightReceiver
from refitkit.transfer._broadcast.sender import BroadcastWeightSender
from refitkit.transfer._ipc.receiver import BucketedWeightReceiver
from refitkit.transfer._ipc.sender import BucketedWeightSender
from refitkit.transfer.common import SessionPhase, TransferStats, WeightVersion

__all__ = [
    "BroadcastWeightReceiver",
    "BroadcastWeightSender",
    "BucketedWeightReceiver",
    "BucketedWeightSender",
    "SessionPhase",
    "TransferStats",
    "WeightVersion",
]
