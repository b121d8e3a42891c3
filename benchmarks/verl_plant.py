"""A planted failure for ``benchmarks/verl_grpo.py --modes killed``: the vLLM worker of verl's rollout SIGKILLs itself
while it receives one sync, to show what a verl user sees then (refitkit's error failing the step within its bounds,
not a hang) and that the run's next attempt syncs cleanly.

``KilledMidSync`` is refitkit's worker extension for verl with one change (``verl_grpo.kill_plan`` reads the knobs):
the ``REFITKIT_PLANT_KILL_SYNC``-th ``refit_receive`` of the worker (1 = the first) arms a timer that kills the worker
``REFITKIT_PLANT_KILL_AFTER_S`` after the call began (default 2 ms: past the handshake, inside the stream of a Qwen3-0.6B-sized sync) and writes the
moment of the kill (``time.time()``) to ``REFITKIT_PLANT_FILE`` first. Benchmark code only: nothing in ``refitkit/``
knows of it. The timer is the fault being injected, not a synchronisation: the benchmark checks afterwards, from the
trainer's error, that the kill did land inside the sync.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from benchmarks.verl_grpo import kill_plan
from refitkit.integrations.verl.vllm import VerlRefitWorkerExtension


def _kill_self(note: str | None) -> None:
    if note:
        with open(note, "w") as file:
            file.write(f"{time.time()!r}\n")
    os.kill(os.getpid(), signal.SIGKILL)


class KilledMidSync(VerlRefitWorkerExtension):
    """refitkit's verl worker extension whose planned sync ends with this worker killed (``kill_plan``)."""

    _plant_syncs = 0

    def refit_receive(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self._plant_syncs += 1
        sync, after_s, note = kill_plan(os.environ)
        if self._plant_syncs == sync:
            timer = threading.Timer(after_s, _kill_self, (note,))
            timer.daemon = True
            timer.start()
        return super().refit_receive(*args, **kwargs)
