"""A receiver process for the Megatron GPU tests: takes one weight stream and saves it, by name, to a file
(OUT ``-``: touches nothing and saves only the totals, for benchmarks/megatron_stream.py).

Started as a plain subprocess (``python -m tests.engines.megatron.stream_receiver ENDPOINT OUT TIMEOUT_S``):
test ranks are daemonic and cannot spawn multiprocessing children.
"""

from __future__ import annotations

import sys

import torch


def main(endpoint: str, out_path: str, timeout_s: float) -> None:
    from refitkit.transfer import BucketedWeightReceiver

    received: dict[str, torch.Tensor] = {}

    def on_bucket(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
        if out_path == "-":
            return
        for name, tensor in weights:
            if name in received:
                raise ValueError(f"{name} arrived twice")
            received[name] = tensor.to("cpu", copy=True)  # the bucket's views die with this call

    stats = BucketedWeightReceiver(endpoint, "cuda", timeout_s=timeout_s).receive(on_bucket)
    if out_path != "-":
        torch.save({"weights": received, "bytes": stats.bytes, "tensors": stats.tensors}, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
