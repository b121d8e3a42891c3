"""Real spawned process worlds for tests: gloo process groups, bounded joins, no hangs."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch

from tests.helpers import procs


class WorldTimeout(TimeoutError):
    pass


def _entry(fn: Callable, rank: int, world_size: int, store_path: str, out_dir: str, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    result_path = os.path.join(out_dir, f"rank{rank}.pt")
    try:
        if world_size > 0:
            dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, result_path)
    except BaseException:  # report every failure to the parent, then exit non-zero
        torch.save({"ok": False, "error": traceback.format_exc()}, result_path)
        raise
    finally:
        if world_size > 0 and dist.is_initialized():
            dist.destroy_process_group()


def run_world(
    fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0, fresh_interpreter: bool = False
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` ranks over gloo, forked from the tests' fork server
    (``procs``), or spawned as fresh interpreters with ``fresh_interpreter`` (for an environment variable read when
    a library loads, as glibc's ``MALLOC_*``).

    Returns each rank's return value (ranks must return torch.save-able values). A rank that
    fails re-raises here with its traceback; ranks still running after ``timeout_s`` are killed
    and ``WorldTimeout`` is raised.
    """
    ctx = mp.get_context("spawn") if fresh_interpreter else procs.context()
    with tempfile.TemporaryDirectory(prefix="refitkit-world-") as tmp:
        store = os.path.join(tmp, "store")
        processes = [
            ctx.Process(target=_entry, args=(fn, rank, world_size, store, tmp, args), daemon=True)
            for rank in range(world_size)
        ]
        for proc in processes:
            proc.start()
        import time

        deadline = time.monotonic() + timeout_s
        for proc in processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        alive = [rank for rank, proc in enumerate(processes) if proc.is_alive()]
        for proc in processes:
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        results = []
        for rank in range(world_size):
            path = os.path.join(tmp, f"rank{rank}.pt")
            if not os.path.exists(path):
                if alive:
                    raise WorldTimeout(f"ranks {alive} still running after timeout_s={timeout_s}; killed")
                raise RuntimeError(f"rank {rank} exited with code {processes[rank].exitcode} and no result")
            payload = torch.load(path, weights_only=False)
            if not payload["ok"]:
                raise RuntimeError(f"rank {rank} failed:\n{payload['error']}")
            results.append(payload["result"])
        if alive:
            raise WorldTimeout(f"ranks {alive} still running after timeout_s={timeout_s}; killed")
        return results


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a test's child interpreter: the checkout first on PYTHONPATH, what was there kept
    (on the GPU machine that is where pyzmq and friends were installed), plus ``extra``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))
    return {**os.environ, "PYTHONPATH": path, **extra}
