"""What `pip install .` gives a user, checked from outside the checkout (run by `make test-install`).

Runs in a fresh venv that holds torch and the wheel with only its ``install_requires`` (no extras, no
pytest), from a directory outside the checkout, so any import the package does not declare fails
here. Real processes throughout: a two-rank gloo refit (FSDP2, weights streamed to a receiver), a
broadcast across two processes, ``refitkit demo``, ``refitkit --help`` and ``refitkit bench``.
Exits 0 when every check passed; each failure is printed with what it got.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
import uuid
from pathlib import Path

import torch

import refitkit
from refitkit.engines import DeviceState
from refitkit.engines.fsdp import FSDPAdapter
from refitkit.refit import RefitCycle
from refitkit.transfer import (
    BroadcastWeightReceiver,
    BroadcastWeightSender,
    BucketedWeightReceiver,
    BucketedWeightSender,
)

TIMEOUT_S = 120.0
SECRET = "install-smoke-secret-0123456789"
REFITKIT = Path(sys.executable).parent / "refitkit"  # the console script the wheel installed


def sha256(tensor: torch.Tensor) -> str:
    """The tensor's raw bytes, hashed without numpy: what is checked here is refitkit's use of it, not ours."""
    return hashlib.sha256(bytes(tensor.detach().cpu().contiguous().view(torch.uint8).flatten().tolist())).hexdigest()


def build_model(world_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same weights on every rank; FSDP2 over the gloo group when there are several ranks."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.GELU(), torch.nn.Linear(48, 16))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def refit_rank(rank: int, world_size: int, store: str, endpoint: str, results: mp.Queue) -> None:
    """One trainer rank: train a step, then refit (rank 0 streams to a receiver thread) and resume."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        model, optimizer = build_model(world_size)
        model(torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))).pow(2).mean().backward()
        optimizer.step()
        adapter = FSDPAdapter(model, optimizer)
        expected = {name: sha256(tensor) for name, tensor in adapter.named_weights()}
        received: dict[str, str] = {}
        sender = receiver_thread = None
        if rank == 0:
            sender = BucketedWeightSender(endpoint, bucket_bytes=1 << 12, transport="shm", timeout_s=60.0)

            def receive() -> None:
                def load(weights: list, is_last: bool) -> None:
                    received.update((name, sha256(tensor)) for name, tensor in weights)

                BucketedWeightReceiver(endpoint, "cpu", timeout_s=60.0).receive(load)

            receiver_thread = threading.Thread(target=receive, daemon=True)
            receiver_thread.start()
        cycle = RefitCycle(adapter, sender, barrier_timeout_s=60.0)
        cycle.refit(step=1)
        offloaded = adapter.state is DeviceState.OFFLOADED
        cycle.resume(step=1)
        if receiver_thread is not None:
            receiver_thread.join(60.0)
            sender.close()
        if rank == 0 and received != expected:
            raise RuntimeError(
                f"the receiver got {sorted(received)} with other bytes than the trainer's {sorted(expected)}"
            )
        if not offloaded or adapter.state is not DeviceState.ON_DEVICE:
            raise RuntimeError(f"rank {rank}: offloaded={offloaded}, state after resume {adapter.state}")
        results.put((rank, "ok"))
    except Exception as exc:  # the parent reports it, with the traceback
        results.put((rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def broadcast_receiver(rendezvous: str, results: mp.Queue) -> None:
    """The engine side of a broadcast: receives one sync and answers each weight's digest."""
    torch.set_num_threads(1)
    try:
        receiver = BroadcastWeightReceiver(rendezvous, secret=SECRET, rank=1, device="cpu", timeout_s=60.0)
        got: dict[str, str] = {}
        receiver.receive(lambda weights, is_last: got.update((name, sha256(tensor)) for name, tensor in weights))
        results.put(("ok", got, receiver.weights_version.version))
    except Exception as exc:  # the parent reports it, with the traceback
        results.put(("failed", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}", None))


def join_all(processes: list[mp.Process]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(5.0)


def check_installed_package() -> str:
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    where = Path(refitkit.__file__).resolve()
    if not where.is_relative_to(site):
        raise RuntimeError(f"refitkit imported from {where}, not from this venv's {site}")
    return f"refitkit from {where.parent}"


def check_two_rank_refit() -> str:
    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="refitkit-smoke-") as folder:
        endpoint = f"smoke-{uuid.uuid4().hex[:8]}"
        ranks = [
            context.Process(
                target=refit_rank, args=(rank, 2, os.path.join(folder, "store"), endpoint, results), daemon=True
            )
            for rank in range(2)
        ]
        for process in ranks:
            process.start()
        try:
            answers = dict(results.get(timeout=TIMEOUT_S) for _ in ranks)
        except queue.Empty:
            raise RuntimeError(
                f"a rank gave no answer within {TIMEOUT_S} s (exit codes {[p.exitcode for p in ranks]})"
            ) from None
        finally:
            join_all(ranks)
    if answers != {0: "ok", 1: "ok"}:
        raise RuntimeError(f"ranks answered {answers}")
    return "2 gloo ranks: refit (rank 0 streamed every weight bit-exact), offload, resume"


def check_broadcast() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        rendezvous = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    context = mp.get_context("spawn")
    results = context.Queue()
    receiver = context.Process(target=broadcast_receiver, args=(rendezvous, results), daemon=True)
    receiver.start()
    torch.manual_seed(1)
    weights = [(f"layer{i}.weight", torch.randn(33, 7 + i)) for i in range(4)]
    try:
        with BroadcastWeightSender(
            rendezvous, secret=SECRET, receivers=1, bucket_bytes=1 << 12, timeout_s=60.0
        ) as sender:
            sender.send(iter(weights), version=7)
        status, got, version = results.get(timeout=TIMEOUT_S)
    except queue.Empty:
        raise RuntimeError(
            f"the receiver gave no answer within {TIMEOUT_S} s (exit code {receiver.exitcode})"
        ) from None
    finally:
        join_all([receiver])
    expected = {name: sha256(tensor) for name, tensor in weights}
    if status != "ok" or got != expected or version != 7:
        raise RuntimeError(f"receiver answered {status}, version {version}: {got}")
    return f"broadcast of {len(weights)} weights to a second process, bit-exact, version {version}"


def refitkit_command(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(REFITKIT), *argv], capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL
    )


def check_demo() -> str:
    done = refitkit_command("demo")
    if done.returncode != 0 or "peer weights bit-identical: True" not in done.stdout:
        raise RuntimeError(f"`refitkit demo` exited {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}")
    return "`refitkit demo` exited 0, peer weights bit-identical"


def check_help() -> str:
    done = refitkit_command("--help")
    if done.returncode != 0 or "{demo,bench,audit}" not in done.stdout:
        raise RuntimeError(
            f"`refitkit --help` exited {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"
        )
    return "`refitkit --help` exited 0"


def check_bench_outside_a_checkout() -> str:
    done = refitkit_command("bench", "--dry-run")
    lines = done.stderr.splitlines()
    expected = "refitkit bench: error: benchmarks run from a source checkout, not from an installed package"
    if done.returncode != 1 or done.stdout or len(lines) != 1 or not lines[0].startswith(expected):
        raise RuntimeError(f"`refitkit bench` exited {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}")
    return f"`refitkit bench` exited 1: {lines[0]}"


CHECKS = [
    check_installed_package,
    check_two_rank_refit,
    check_broadcast,
    check_demo,
    check_help,
    check_bench_outside_a_checkout,
]


def main() -> int:
    failed = 0
    for check in CHECKS:
        start = time.monotonic()
        try:
            said = check()
        except Exception as exc:
            failed += 1
            print(
                f"FAILED {check.__name__} ({time.monotonic() - start:.1f} s): {type(exc).__name__}: {exc}", flush=True
            )
        else:
            print(f"ok {check.__name__} ({time.monotonic() - start:.1f} s): {said}", flush=True)
    print(f"install smoke: {len(CHECKS) - failed} of {len(CHECKS)} checks ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
