"""A receiver process for the Megatron GPU tests: takes one weight stream and saves it, by name, to a file
(OUT ``-``: touches nothing and saves only the totals, for benchmarks/megatron_stream.py, which passes
SESSIONS > 1 so that one receiver, started once, takes every timed round).

Started as a plain subprocess (``python -m tests.engines.megatron.stream_receiver ENDPOINT OUT TIMEOUT_S [SESSIONS [DEVICE]]``):
test ranks are daemonic and cannot spawn multiprocessing children.
"""

from __future__ import annotations

import sys

import torch


def main(endpoint: str, out_path: str, timeout_s: float, sessions: int = 1, device: str = "cuda") -> None:
    from refitkit.transfer import BucketedWeightReceiver

    received: dict[str, torch.Tensor] = {}

    def on_bucket(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
        if out_path == "-":
            return
        for name, tensor in weights:
            if name in received:
                raise ValueError(f"{name} arrived twice")
            received[name] = tensor.to("cpu", copy=True)  # the bucket's views die with this call

    receiver = BucketedWeightReceiver(endpoint, device, timeout_s=timeout_s)
    for _ in range(sessions):
        received.clear()  # what is saved is the last session's stream
        stats = receiver.receive(on_bucket)
    if out_path != "-":
        torch.save({"weights": received, "bytes": stats.bytes, "tensors": stats.tensors}, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 1, *sys.argv[5:6])
