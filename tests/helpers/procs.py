"""The start method of the tests' child processes: a fork server that imported torch once.

A spawned child re-imports torch, about 2.7 s of CPU on the 2-core CI machine, and the suites start hundreds of
them. A fork server (multiprocessing's own, started on first use) imports torch, torch.distributed and refitkit once;
each child is a fork of it and starts in a fraction of a second. The server never touches CUDA, so a child may still
initialise CUDA itself (the GPU machine's tests do).

The server freezes its heap last (``frozen_heap``): a child's full collections then skip torch's objects. The server
finds ``tests`` on the path of its working directory (multiprocessing ignores the parent's ``sys.path`` there), so
pytest runs from the repository's root; ``tests/test_procs.py`` checks that a child sees the frozen heap.

A fork server child inherits the server's environment, not the test's. ``Process.start`` therefore takes the test's
environment at that moment and the child applies it before its target runs: a variable a test sets (``monkeypatch``)
reaches the child as with spawn. A variable read when a library loads (``MALLOC_*``, ``OMP_NUM_THREADS`` for
OpenMP's pool) is read in the server, not the child: a test that needs one spawns (``mp.get_context("spawn")``).
"""

from __future__ import annotations

import importlib.util
import multiprocessing.context as mpc
import os

PRELOAD = ["torch", "torch.distributed", "refitkit"]
FREEZE = "tests.helpers.frozen_heap"  # imported after PRELOAD: freezes the server's heap before it forks
_started = False  # whether the server may be running (the modules it imports are fixed then)


class _Process(mpc.ForkServerProcess):
    _environment: dict[str, str] | None = None

    def start(self) -> None:
        global _started
        _started = True
        self._environment = dict(os.environ)
        super().start()

    def run(self) -> None:
        if self._environment is not None:
            os.environ.clear()
            os.environ.update(self._environment)
        super().run()


class _Context(mpc.ForkServerContext):
    Process = _Process


_CONTEXT = _Context()
_CONTEXT.set_forkserver_preload([*PRELOAD, FREEZE])


def preload(*modules: str) -> None:
    """Have the fork server import ``modules`` too, those of a package this environment has (an engine suite's
    conftest: megatron.core takes 5 s a child). Only before the first child starts."""
    if _started:
        raise RuntimeError(f"procs.preload{modules}: the fork server may be running; call it from a conftest")
    installed = [m for m in modules if importlib.util.find_spec(m.partition(".")[0]) is not None]
    PRELOAD.extend(m for m in installed if m not in PRELOAD)
    _CONTEXT.set_forkserver_preload([*PRELOAD, FREEZE])


def context() -> mpc.BaseContext:
    """The context to start a test's child processes from (``.Process``, ``.Pipe``, ``.Event``, ``.Pool``)."""
    return _CONTEXT
