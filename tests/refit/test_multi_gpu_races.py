"""The seed's race on NCCL: FSDP2 over every GPU (up to 8), rank 0 streaming to a receiver on GPU 0.

The CPU (gloo) versions of these cases are in test_failures.py (one process group, a model with no
gathers, or two ranks on one GPU). Here the trainer's group is NCCL, the weights are gathered by
FSDP2 all-gathers across GPUs, and "memory freed" is read from the driver with NVML:

- a rank 3 s late in its offload: rank 0's ``refit()`` returns only after every other GPU is back
  to its baseline (read from rank 0 right after refit returns);
- a rank that takes part in the gathers but never reaches the exchange: ``BarrierTimeout`` on the
  others within ``barrier_timeout_s`` + slack, every process alive, the NCCL group usable;
- rank 0's receiver SIGKILLed mid-sync: every rank ends in a refitkit error within ``timeout_s`` +
  ``barrier_timeout_s`` (the other ranks finish their all-gathers instead of waiting in one).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.helpers import procs

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(600)]

GIB = 1 << 30
DIM, LAYERS_PER_RANK = 8192, 8  # 128 MiB bf16 weights; per rank ~3 GiB of params + AdamW state at any world size
FREED_SLACK_BYTES = 1 * GIB  # what a GPU may hold over its baseline once its rank offloaded (allocator / NCCL scraps)
LATE_S = 3.0


def world_size() -> int:
    return min(torch.cuda.device_count(), 8)


# -- a world of NCCL ranks ----------------------------------------------------------------------


def _entry(fn: Callable, rank: int, world: int, device_type: str, store_path: str, out_dir: str, args: tuple) -> None:
    import torch.distributed as dist

    result_path = os.path.join(out_dir, f"rank{rank}.json")
    try:
        if device_type == "cuda":
            torch.cuda.set_device(rank)
            dist.init_process_group(
                "nccl",
                init_method=f"file://{store_path}",
                rank=rank,
                world_size=world,
                device_id=torch.device("cuda", rank),
            )
        else:  # only for checking this module's logic on a CPU box by hand (see the report); tests use cuda
            torch.set_num_threads(1)
            dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
        result = {"ok": True, "result": fn(rank, world, device_type, *args)}
    except BaseException:
        result = {"ok": False, "error": traceback.format_exc()}
    with open(result_path, "w") as handle:
        json.dump(result, handle)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, *args: Any, device_type: str = "cuda", timeout_s: float = 400.0) -> list[dict]:
    """``fn(rank, world, device_type, *args)`` on ``world`` spawned ranks (NCCL on cuda); their JSON results."""
    context = procs.context()
    with tempfile.TemporaryDirectory(prefix="refitkit-races-") as tmp:
        store = os.path.join(tmp, "store")
        processes = [
            context.Process(target=_entry, args=(fn, rank, world, device_type, store, tmp, args), daemon=True)
            for rank in range(world)
        ]
        for proc in processes:
            proc.start()
        deadline = time.monotonic() + timeout_s
        for proc in processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        alive = [rank for rank, proc in enumerate(processes) if proc.is_alive()]
        for proc in processes:
            if proc.is_alive():
                proc.kill()
                proc.join(10.0)
        if alive:
            raise AssertionError(f"ranks {alive} still running after {timeout_s} s; killed")
        results = []
        for rank in range(world):
            path = os.path.join(tmp, f"rank{rank}.json")
            if not os.path.exists(path):
                raise AssertionError(f"rank {rank} exited with code {processes[rank].exitcode} and no result")
            with open(path) as handle:
                payload = json.load(handle)
            if not payload["ok"]:
                raise AssertionError(f"rank {rank} failed:\n{payload['error']}")
            results.append(payload["result"])
        return results


# -- the receiver on GPU 0 ----------------------------------------------------------------------


def receiver_process(endpoint: str, device: str, mode: str, timeout_s: float) -> None:
    """An engine on ``device``: copies every weight into its own tensors (``copy``), or SIGKILLs itself at
    its second bucket (``kill``). Prints ``starting``, then the bytes it loaded as JSON."""
    from refitkit.transfer import BucketedWeightReceiver

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        torch.zeros(1, device=device)  # its context exists before the sender starts
    print("starting", flush=True)
    receiver = BucketedWeightReceiver(endpoint, device, timeout_s=timeout_s)
    params: dict[str, torch.Tensor] = {}
    buckets = 0

    def load(weights, is_last: bool) -> None:
        nonlocal buckets
        buckets += 1
        if mode == "kill" and buckets == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        for name, tensor in weights:
            params.setdefault(name, torch.empty_like(tensor)).copy_(tensor)

    receiver.receive(load)
    print(
        json.dumps({"bytes": sum(t.numel() * t.element_size() for t in params.values()), "tensors": len(params)}),
        flush=True,
    )


def start_receiver(device: str, mode: str, timeout_s: float) -> tuple[str, subprocess.Popen]:
    # a plain subprocess: rank processes are daemonic and may not have multiprocessing children
    from tests.helpers.world import child_env

    endpoint = f"races-{uuid.uuid4().hex[:8]}"
    code = f"from tests.refit.test_multi_gpu_races import receiver_process; receiver_process({endpoint!r}, {device!r}, {mode!r}, {timeout_s!r})"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=child_env())
    if process.stdout is None or process.stdout.readline().strip() != "starting":
        process.kill()
        raise AssertionError("the receiver process did not start")
    return endpoint, process


def receiver_result(process: subprocess.Popen) -> dict:
    output, _ = process.communicate(timeout=120)
    lines = [line for line in output.splitlines() if line.startswith("{")]
    return {"exit": process.returncode, **(json.loads(lines[-1]) if lines else {})}


# -- the trainer on each rank -------------------------------------------------------------------


class Trainer:
    """FSDP2 over all ranks: ``layers`` square bf16 linears (one FSDP unit each), AdamW, one step taken.
    ``read_memory``: rank 0 reads every GPU's used memory before the model exists and once it is trained."""

    def __init__(
        self, rank: int, world: int, device_type: str, dim: int, layers: int, *, read_memory: bool = False
    ) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from refitkit.engines.fsdp import FSDPAdapter

        self.rank, self.world, self.dim = rank, world, dim
        self.device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
        mesh = init_device_mesh(device_type, (world,))
        for group in (None, mesh.get_group()):  # communicators exist before the baseline is read
            self.all_reduce(1.0, group)
        _settle(self.device)
        dist.barrier()
        self.baseline = gpu_used_bytes(world) if rank == 0 and read_memory else None
        dist.barrier()
        torch.manual_seed(0)  # the same initial weights on every rank
        self.model = torch.nn.Sequential(
            *(torch.nn.Linear(dim, dim, bias=False, device=self.device, dtype=torch.bfloat16) for _ in range(layers))
        )
        for layer in self.model:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=device_type == "cuda")
        self.step(0)
        self.adapter = FSDPAdapter(self.model, self.optimizer)
        self.model_bytes = layers * dim * dim * 2  # what a full weight sync streams
        self.bucket_bytes = min(256 << 20, self.model_bytes // 4)  # several buckets, so a receiver can die mid-sync
        _settle(self.device)
        dist.barrier()
        self.loaded = gpu_used_bytes(world) if rank == 0 and read_memory else None  # every GPU holds its share now
        dist.barrier()

    def step(self, index: int) -> float:
        generator = torch.Generator(device=self.device).manual_seed(1000 * self.rank + index)
        x = torch.randn(4, self.dim, generator=generator, device=self.device, dtype=torch.bfloat16)
        loss = self.model(x).float().square().mean()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.item())

    def all_reduce(self, value: float, group: Any = None) -> float:
        import torch.distributed as dist

        tensor = torch.tensor([value], device=self.device)
        dist.all_reduce(tensor, group=group)
        return float(tensor.item())


def _settle(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def gpu_used_bytes(world: int) -> list[int] | None:
    """Each GPU's used memory as the driver counts it (every process on it), from NVML; None on CPU."""
    if not torch.cuda.is_available():
        return None
    import pynvml  # nvidia-ml-py: installed on the GPU machine (the test skips without it)

    pynvml.nvmlInit()
    used = []
    for index in range(world):
        try:  # the CUDA index may not be NVML's (CUDA_VISIBLE_DEVICES): match by UUID
            handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{torch.cuda.get_device_properties(index).uuid}")
        except Exception:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        used.append(int(pynvml.nvmlDeviceGetMemoryInfo(handle).used))
    return used


def attempt_refit(cycle: Any, step: int) -> dict:
    """One refit() as data: the error's type and message (None when it succeeded), its seconds, when it ended."""
    start = time.monotonic()
    try:
        cycle.refit(step)
        outcome: dict = {"error_type": None}
    except Exception as exc:
        outcome = {"error_type": type(exc).__name__, "error": str(exc)}
    outcome["seconds"] = time.monotonic() - start
    outcome["ended_at"] = time.time()
    return outcome


def late_rank(rank: int, world: int, device_type: str, dim: int, layers: int) -> dict:
    """The last rank sleeps LATE_S between its weight sync and its offload; rank 0 reads every GPU's memory
    before its own barrier (the late GPU still full) and right after refit() returns (every GPU freed)."""
    from refitkit.refit import RefitCycle
    from refitkit.transfer import BucketedWeightSender

    trainer = Trainer(rank, world, device_type, dim, layers, read_memory=True)
    late = world - 1
    readings: dict[str, Any] = {}
    sender = process = None
    if rank == 0:
        endpoint, process = start_receiver(
            str(torch.device(device_type, 0)) if device_type == "cuda" else "cpu", "copy", 60.0
        )
        transport = "cuda_ipc" if device_type == "cuda" else "shm"
        sender = BucketedWeightSender(endpoint, bucket_bytes=trainer.bucket_bytes, transport=transport, timeout_s=60.0)

    def on_phase(phase: str) -> None:
        if rank == late and phase == "sync_weights":
            time.sleep(
                LATE_S
            )  # test input: this rank is late to offload (FSDP's gathers would absorb an earlier delay)
        if rank == 0 and phase == "flush_device":
            readings["before_barrier"] = gpu_used_bytes(world)

    cycle = RefitCycle(trainer.adapter, sender, barrier_timeout_s=60.0, on_phase=on_phase)
    report = cycle.refit(1)
    readings["after_refit"] = gpu_used_bytes(world) if rank == 0 else None  # first thing after refit returns
    returned_at = time.time()
    cycle.resume(1)
    loss = trainer.step(1)
    outcome = {
        "refit_s": report.seconds,
        "returned_at": returned_at,
        "barrier_s": report.phase("barrier").seconds,
        "baseline": trainer.baseline,
        "loaded": trainer.loaded,
        **readings,
        "loss": loss,
        "model_bytes": trainer.model_bytes,
    }
    if process is not None:
        sender.close()
        outcome["receiver"] = receiver_result(process)
    cycle.close()
    return outcome


def rank_misses_the_barrier(
    rank: int, world: int, device_type: str, dim: int, layers: int, barrier_timeout_s: float
) -> dict:
    """The last rank never calls refit() (test input: it stays in its own 'step'); the others must time out at
    the exchange that opens every refit, before any gather, and every rank's NCCL group must still work."""
    from refitkit.refit import RefitCycle

    trainer = Trainer(rank, world, device_type, dim, layers)
    missing = world - 1
    cycle = RefitCycle(trainer.adapter, None, barrier_timeout_s=barrier_timeout_s)
    if rank == missing:
        outcome: dict = {"absent_from": time.time()}
        time.sleep(barrier_timeout_s + 5.0)  # absent until the others have given up
    else:
        outcome = attempt_refit(cycle, 1)
        outcome["state"] = trainer.adapter.state.name
        if outcome["state"] != "ON_DEVICE":  # a wrong outcome: bring the state back so the step below cannot crash
            trainer.adapter.reload()
    outcome["all_reduce"] = trainer.all_reduce(rank + 1.0)  # the trainer's NCCL group, on every rank
    outcome["loss_after"] = trainer.step(1)  # FSDP's all-gathers and reduce-scatters still work
    return outcome  # the cycle's gloo group is spent (test_failures.py checks what it says)


def sender_loses_its_receiver(
    rank: int, world: int, device_type: str, dim: int, layers: int, timeout_s: float, barrier_timeout_s: float
) -> dict:
    """Rank 0's receiver SIGKILLs itself at its second bucket: every rank must end in a refitkit error within
    timeout_s + barrier_timeout_s, nothing offloaded, the NCCL group and FSDP training usable afterwards."""
    from refitkit.refit import RefitCycle
    from refitkit.transfer import BucketedWeightSender

    trainer = Trainer(rank, world, device_type, dim, layers)
    sender = process = None
    if rank == 0:
        endpoint, process = start_receiver(
            str(torch.device(device_type, 0)) if device_type == "cuda" else "cpu", "kill", 60.0
        )
        transport = "cuda_ipc" if device_type == "cuda" else "shm"
        sender = BucketedWeightSender(
            endpoint, bucket_bytes=trainer.bucket_bytes, transport=transport, timeout_s=timeout_s
        )
    cycle = RefitCycle(trainer.adapter, sender, barrier_timeout_s=barrier_timeout_s)
    outcome = attempt_refit(cycle, 1)
    outcome["state"] = trainer.adapter.state.name
    if outcome["state"] != "ON_DEVICE":  # a wrong outcome: bring the state back so the step below cannot crash
        cycle.resume(1)
    outcome["all_reduce"] = trainer.all_reduce(rank + 1.0)
    outcome["loss_after"] = trainer.step(1)
    if process is not None:
        outcome["receiver_exit"] = process.wait(60)
        sender.close()
    cycle.close()
    return outcome


# -- the tests ----------------------------------------------------------------------------------


@pytest.fixture
def world() -> int:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2+ GPUs (the multi-GPU machine kinds)")
    return world_size()


def test_a_late_rank_holds_rank_0_until_every_gpu_is_freed(world):
    pytest.importorskip("pynvml")
    results = run_ranks(late_rank, world, DIM, LAYERS_PER_RANK * world)
    rank0 = results[0]
    late = world - 1
    state_bytes = 3 * rank0["model_bytes"] // world  # bf16 params + two AdamW moments, sharded
    for gpu in range(1, world):
        assert rank0["loaded"][gpu] - rank0["baseline"][gpu] > state_bytes // 2, (
            gpu,
            rank0,
        )  # the reading sees the state
    # before rank 0's barrier the late GPU still holds its state: the reading would catch an early return
    assert rank0["before_barrier"][late] - rank0["baseline"][late] > state_bytes // 2, rank0
    for gpu in range(1, world):
        held = rank0["after_refit"][gpu] - rank0["baseline"][gpu]
        assert held < FREED_SLACK_BYTES, f"GPU {gpu} still held {held / GIB:.2f} GiB when rank 0's refit() returned"
    assert rank0["refit_s"] > LATE_S - 0.5 and rank0["barrier_s"] > LATE_S - 1.5, rank0  # it really waited
    assert results[late]["barrier_s"] < rank0["barrier_s"], results  # the late rank found the others waiting
    assert rank0["receiver"] == {"exit": 0, "bytes": rank0["model_bytes"], "tensors": LAYERS_PER_RANK * world}
    assert all(r["loss"] == r["loss"] for r in results)  # trained again after resume


def test_a_rank_that_never_reaches_the_barrier_times_the_others_out_and_leaves_nccl_usable(world):
    barrier_timeout_s = 10.0
    results = run_ranks(rank_misses_the_barrier, world, DIM, LAYERS_PER_RANK * world, barrier_timeout_s)
    missing = results[-1]
    total = world * (world + 1) / 2
    for rank, outcome in enumerate(results[:-1]):
        assert outcome["error_type"] == "BarrierTimeout", (rank, outcome)
        assert f"arrival at refit) timed out after {barrier_timeout_s:.1f} s on rank {rank}" in outcome["error"]
        assert "barrier_timeout_s" in outcome["error"]
        waited = outcome["ended_at"] - missing["absent_from"]  # the same host's clock
        assert waited < barrier_timeout_s + 5.0, (rank, waited)
        assert outcome["state"] == "ON_DEVICE", outcome  # nothing moves when a rank never arrived
    for outcome in results:
        assert outcome["all_reduce"] == total, outcome  # every process alive, the NCCL group in step
        assert outcome["loss_after"] == outcome["loss_after"], outcome


def test_a_sending_rank_whose_receiver_is_gone_fails_every_rank_within_the_bounds(world):
    timeout_s, barrier_timeout_s = 5.0, 30.0
    results = run_ranks(sender_loses_its_receiver, world, DIM, LAYERS_PER_RANK * world, timeout_s, barrier_timeout_s)
    rank0 = results[0]
    assert rank0["error_type"] == "TransferTimeout", rank0
    assert rank0["receiver_exit"] == -signal.SIGKILL
    for rank, outcome in enumerate(results[1:], start=1):
        assert outcome["error_type"] == "RankFailure", (rank, outcome)
        assert "sync_weights failed on rank(s) 0" in outcome["error"] and "TransferTimeout" in outcome["error"]
    for outcome in results:
        assert outcome["seconds"] < timeout_s + barrier_timeout_s, outcome
        assert outcome["state"] == "ON_DEVICE", outcome
        assert outcome["all_reduce"] == world * (world + 1) / 2, outcome
        assert outcome["loss_after"] == outcome["loss_after"], outcome


if __name__ == "__main__":  # the rank functions' logic on a CPU box over gloo (no NVML, no asserts): by hand only
    for scenario, extra in (
        (late_rank, ()),
        (rank_misses_the_barrier, (4.0,)),
        (sender_loses_its_receiver, (2.0, 20.0)),
    ):
        for outcome in run_ranks(scenario, 2, 256, 16, *extra, device_type="cpu", timeout_s=200):
            print(scenario.__name__, json.dumps(outcome)[:400])
