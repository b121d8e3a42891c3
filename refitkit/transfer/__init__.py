"""Weight transfer from the trainer to the inference engine, in two wings.

- One host (``_ipc``): a ``SenderChannel`` (the trainer rank's end; ``BucketedWeightSender`` is the
  same class under its first name) binds an endpoint and streams (name, tensor) pairs through a
  double-buffered bucket in CUDA IPC or shared memory, with ZMQ control frames; a ``ReceiverChannel``
  (the engine rank's end; ``BucketedWeightReceiver``) connects once, maps the bucket once per sync and
  hands the tensors to a loader. Each is opened once, runs one sync per call and is closed by
  ``close()``; nothing of it outlives it. ``_ipc/sender.py`` and ``_ipc/receiver.py`` hold the session rules.
- Other GPUs or nodes (``_broadcast``): ``BroadcastWeightSender`` / ``BroadcastWeightReceiver`` carry
  the same streams over a torch.distributed broadcast (gloo or NCCL) on a group of their own, formed
  through a TCPStore rendezvous by the first sync, admitted by a per-job secret, kept by both ends for
  the next syncs and dropped by ``close()`` or a failed sync. ``_broadcast/sender.py`` holds the
  session and the security model.

Both share ``protocol`` (the wire format), ``packing`` (checking items, laying out buckets) and
``common`` (session phases, ``TransferStats``, ``WeightVersion``, the knob checks).
"""

from refitkit.transfer._broadcast.receiver import BroadcastWeightReceiver
from refitkit.transfer._broadcast.sender import BroadcastWeightSender
from refitkit.transfer._ipc.receiver import BucketedWeightReceiver, ReceiverChannel
from refitkit.transfer._ipc.sender import BucketedWeightSender, SenderChannel
from refitkit.transfer.common import ChannelState, SessionPhase, TransferStats, WeightVersion

__all__ = [
    "BroadcastWeightReceiver",
    "BroadcastWeightSender",
    "BucketedWeightReceiver",
    "BucketedWeightSender",
    "ChannelState",
    "ReceiverChannel",
    "SenderChannel",
    "SessionPhase",
    "TransferStats",
    "WeightVersion",
]
