"""A trainer process that sends a tiny bf16 Llama over CUDA IPC and is SIGKILLed part-way through the stream."""

from __future__ import annotations

import os
import signal
from typing import Any


def send_then_die(name: str, die_at: int, timeout_s: float, ready: Any) -> None:
    """Bind ``name``, report its path, then send; SIGKILL ourselves when tensor ``die_at`` is asked for."""
    import torch

    from examples.tiny_llama import random_llama
    from refitkit.transfer import BucketedWeightSender

    model = random_llama(seed=7).to(device="cuda", dtype=torch.bfloat16)
    with BucketedWeightSender(name, bucket_bytes=64 << 10, transport="cuda_ipc", timeout_s=timeout_s) as sender:
        ready.put(str(sender.path))

        def weights():
            for index, item in enumerate(model.named_parameters()):
                if index == die_at:
                    os.kill(os.getpid(), signal.SIGKILL)  # mid-stream: earlier buckets landed in the engine
                yield item

        sender.send(weights())
