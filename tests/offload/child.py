"""Run a test body in a fresh spawned process, and squeeze that process's memory for real."""

from __future__ import annotations

import resource
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tests.helpers import procs


def run_in_child(fn: Callable[..., Any], *args: Any, timeout_s: float = 90.0) -> Any:
    """``fn(*args)`` in a fresh spawned process (its own address-space limit); bounded by ``timeout_s``."""
    with procs.context().Pool(1) as pool:
        return pool.apply_async(fn, args).get(timeout_s)


def _address_space_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextmanager
def address_space_headroom(headroom_bytes: int) -> Iterator[None]:
    """Allow this process only ``headroom_bytes`` more address space inside the block."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_address_space_bytes() + headroom_bytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
