"""Pipeline stage forwarding: seconds and microseconds a weight of one named_weights() pass with
``pp_group`` (every stage's weights reach every pipeline rank), against the same pass without it.

CPU, two spawned ranks over gloo (from the repo root):
    python benchmarks/pipeline_stages.py --layers 200 --dim 64
GPUs, any pipeline size, NCCL for the tensors (the headers always go over gloo):
    torchrun --nproc-per-node 2 benchmarks/pipeline_stages.py --layers 200 --dim 1024
Each rank holds ``--layers / world size`` linear layers (weight and bias) of the same model.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _stage(rank: int, world_size: int, layers: int, dim: int, device: torch.device) -> nn.Module:
    per_stage = layers // world_size
    model = nn.Module()
    model.layers = nn.ModuleDict(
        {str(index): nn.Linear(dim, dim) for index in range(rank * per_stage, (rank + 1) * per_stage)}
    )
    return model.to(device)


def _pass_s(adapter, device: torch.device) -> tuple[float, int]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    count = sum(1 for _ in adapter.named_weights())
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, count


def rank_main(rank: int, world_size: int, layers: int, dim: int, rounds: int) -> dict:
    import torch.distributed as dist

    from refitkit.engines.fsdp import FSDPAdapter

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    model = _stage(rank, world_size, layers, dim, device)
    pp_group = dist.new_group(list(range(world_size)))
    local = FSDPAdapter(model)
    piped = FSDPAdapter(model, pp_group=pp_group)
    _pass_s(piped, device)  # warm-up: the header group is made at the first pass
    piped_s, local_s = [], []
    for _ in range(rounds):
        dist.barrier()
        piped_s.append(_pass_s(piped, device)[0])
        local_s.append(_pass_s(local, device)[0])
    _, count = _pass_s(piped, device)
    best, floor = min(piped_s), min(local_s)
    return {
        "rank": rank,
        "world_size": world_size,
        "weights": count,
        "dim": dim,
        "bounded_headers": "pp_timeout_s" in inspect.signature(FSDPAdapter).parameters,
        "pass_s": round(best, 5),
        "local_pass_s": round(floor, 5),
        "us_per_weight": round((best - floor) / count * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--world-size", type=int, default=2, help="spawned CPU ranks (ignored under torchrun)")
    args = parser.parse_args()
    if "RANK" in os.environ:  # torchrun
        import torch.distributed as dist

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
        result = rank_main(dist.get_rank(), dist.get_world_size(), args.layers, args.dim, args.rounds)
        if dist.get_rank() == 0:
            print(json.dumps(result))
        dist.destroy_process_group()
        return
    from tests.helpers.world import run_world

    results = run_world(rank_main, args.world_size, args.layers, args.dim, args.rounds, timeout_s=600)
    print(json.dumps(results[0]))


if __name__ == "__main__":
    main()
