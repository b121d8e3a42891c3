"""A trainer process that broadcasts a tiny Llama and is SIGKILLed part-way through the stream."""

from __future__ import annotations

import os
import signal
from typing import Any


def send_then_die(
    port: int, secret: str, version: int, die_at: int, bucket_bytes: int, timeout_s: float, ready: Any
) -> None:
    """Host the rendezvous on ``port``, then send version ``version``; SIGKILL ourselves when tensor ``die_at`` is asked for."""
    from examples.tiny_llama import random_llama
    from refitkit.transfer import BroadcastWeightSender

    model = random_llama(seed=7)
    sender = BroadcastWeightSender(
        ("127.0.0.1", port), secret=secret, receivers=1, bucket_bytes=bucket_bytes, timeout_s=timeout_s
    )
    ready.put(os.getpid())

    def weights():
        for index, item in enumerate(model.named_parameters()):
            if index == die_at:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-stream: earlier buckets are on the engine's side
            yield item

    sender.send(weights(), version=version)
