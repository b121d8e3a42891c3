"""Bucketed weight transfer from the trainer to the inference engine: ZMQ + CUDA IPC or shared memory.

``BucketedWeightSender`` binds an endpoint and streams (name, tensor) pairs through a
double-buffered bucket; ``BucketedWeightReceiver`` connects, maps the bucket once per session and
hands the tensors to a loader. See ``sender``/``receiver`` for the session rules and ``protocol``
for the wire format.

``BroadcastWeightSender`` / ``BroadcastWeightReceiver`` carry the same streams to engines on other
GPUs or nodes: a torch.distributed broadcast (gloo or NCCL) over a group formed per session through
a TCPStore rendezvous, admitted by a per-job secret; the receiver keeps a ``WeightVersion``. See
``broadcast_sender`` for the session and the security model.
"""

from refitkit.transfer.broadcast_receiver import BroadcastWeightReceiver, WeightVersion
from refitkit.transfer.broadcast_sender import BroadcastWeightSender
from refitkit.transfer.phases import SessionPhase, TransferStats
from refitkit.transfer.receiver import BucketedWeightReceiver
from refitkit.transfer.sender import BucketedWeightSender

__all__ = [
    "BroadcastWeightReceiver", "BroadcastWeightSender", "BucketedWeightReceiver", "BucketedWeightSender",
    "SessionPhase", "TransferStats", "WeightVersion",
]
