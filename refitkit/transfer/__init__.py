"""Bucketed weight transfer from the trainer to the inference engine: ZMQ + CUDA IPC or shared memory.

``BucketedWeightSender`` binds an endpoint and streams (name, tensor) pairs through a
double-buffered bucket; ``BucketedWeightReceiver`` connects, maps the bucket once per session and
hands the tensors to a loader. See ``sender``/``receiver`` for the session rules and ``protocol``
for the wire format.
"""

from refitkit.transfer.phases import SessionPhase, TransferStats
from refitkit.transfer.receiver import BucketedWeightReceiver
from refitkit.transfer.sender import BucketedWeightSender

__all__ = ["BucketedWeightReceiver", "BucketedWeightSender", "SessionPhase", "TransferStats"]
