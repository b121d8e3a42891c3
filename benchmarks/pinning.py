"""Host pinning cost per GiB: why HostArena prefaults pages before cudaHostRegister (GPU).

Run: python benchmarks/pinning.py [--gib 4]
"""

from __future__ import annotations

import argparse
import time

import torch


def _timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=int, default=4)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("pinning benchmark needs CUDA; skipped")
        return
    nbytes = args.gib << 30
    cudart = torch.cuda.cudart()
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    seconds = _timed(lambda: cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0))
    print(f"cudaHostRegister of untouched pages: {seconds / args.gib:.3f} s/GiB")
    cudart.cudaHostUnregister(buffer.data_ptr())
    del buffer
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    seconds = _timed(lambda: (buffer.zero_(), cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)))
    print(
        f"parallel prefault ({torch.get_num_threads()} threads) + register (HostArena): {seconds / args.gib:.3f} s/GiB"
    )
    cudart.cudaHostUnregister(buffer.data_ptr())
    del buffer
    seconds = _timed(lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
    print(f"torch pin_memory=True (cudaHostAlloc, power-of-two caching): {seconds / args.gib:.3f} s/GiB")


if __name__ == "__main__":
    main()
