"""The phases of verl's own colocated ``update_weights`` (``benchmarks/verl_grpo.py --modes naive``), read from verl's
own instrumentation: the worker logs its device memory at each boundary (``log_gpu_memory_usage`` in
``ActorRolloutRefWorker.update_weights``, ``verl/workers/engine_workers.py:770-824`` of verl 0.9.1) at DEBUG, on
trainer rank 0. Loaded in every worker as the model's ``external_lib`` (configuration, no patch of verl's code), this
module turns that one logger on and records, for each boundary line, when it came (``time.time()``), the process's
host RSS and the device's free bytes, one JSON line each in ``$REFITKIT_BENCH_BOUNDARIES_FILE``.

``phases`` turns the lines back into one record per ``update_weights`` call with the phase names of refitkit's verl
manager (``refitkit.integrations.verl.colocated.PHASES``): ``wake_weights``, ``sync`` (verl's ``get_per_tensor_param``
and its rollout's ``update_weights``), ``trainer_offload``, and ``barrier_kv_wake`` (verl logs nothing between its
barrier and its KV wake, so the two are one span here). These spans are timed inside the trainer's worker, from its
first boundary line to its last; refitkit's manager times its phases on the driver, Ray's round trips included. Only
verl's own ``timing_s/update_weights`` is timed the same way in both modes. Benchmark code only: nothing in
``refitkit/`` knows of it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from collections.abc import Iterable
from typing import Any

FILE_ENV = "REFITKIT_BENCH_BOUNDARIES_FILE"
# the lines verl 0.9.1's naive update_weights logs, in order, and the phase each one ends
BOUNDARIES = (
    ("Before resume weights", None),
    ("After resume weights", "wake_weights"),
    ("After update_weights", "sync"),
    ("After offload model to cpu", "trainer_offload"),
    ("After resume kv_cache", "barrier_kv_wake"),
)
HEADS = tuple(head for head, _ in BOUNDARIES)
WORKER_MODULE = "verl.workers.engine_workers"  # its logger is named after its file


class BoundaryRecorder(logging.Handler):
    """Appends a JSON line to ``path`` for each record of a boundary line: its head, the time, host RSS, device free."""

    def __init__(self, path: str) -> None:
        super().__init__(level=logging.DEBUG)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        head = str(record.msg).split(",", 1)[0]
        if head not in HEADS:
            return
        try:  # an error here would otherwise reach verl's update_weights through its log call and fail the step
            line = {"head": head, "t": time.time(), "pid": os.getpid(), "host_rss_bytes": _host_rss_bytes()}
            free = _device_free_bytes()
            if free is not None:
                line["device_free_bytes"] = free
            with open(self.path, "a", encoding="utf-8") as out:
                out.write(json.dumps(line, sort_keys=True) + "\n")
        except Exception:
            self.handleError(record)  # logging's own way: a traceback on stderr, the caller goes on


def install(environ: Any = os.environ) -> logging.Handler | None:
    """Record verl's worker boundaries into ``environ[FILE_ENV]`` (nothing when unset); the handler, once per logger."""
    path = environ.get(FILE_ENV)
    if not path:
        return None
    if importlib.util.find_spec(WORKER_MODULE) is None:
        raise RuntimeError(f"{FILE_ENV} is set but {WORKER_MODULE} is not importable: is verl 0.9.1 installed?")
    # its logger (named after its file) gets its level when the module is imported: ours must come after
    logger = importlib.import_module(WORKER_MODULE).logger
    logger.setLevel(logging.DEBUG)
    for handler in logger.handlers:
        if isinstance(handler, BoundaryRecorder) and handler.path == path:
            return handler
    handler = BoundaryRecorder(path)
    logger.addHandler(handler)
    return handler


def phases(lines: Iterable[dict[str, Any]]) -> list[dict[str, float]]:
    """One record per ``update_weights`` call, in order (each ``Before resume weights`` line begins one): each
    phase's seconds, ``total_s``, host RSS and device free after each phase, and ``kv_wake_took_bytes`` (device free
    after the offload less after the KV wake). A call whose lines are not all there, in order, from one process (cut
    short, or mixed with another) is an empty record, so the calls after it keep their places."""
    calls: list[dict[str, float]] = []
    open_call: list[dict[str, Any]] | None = None  # the lines of the call in progress; None: it broke
    for line in lines:
        if line["head"] == HEADS[0]:
            calls.append({})
            open_call = [line]
            continue
        if not open_call or line["pid"] != open_call[0]["pid"] or line["head"] != HEADS[len(open_call)]:
            open_call = None  # not this call's next boundary: the call stays empty
            continue
        open_call.append(line)
        if len(open_call) == len(HEADS):
            calls[-1] = _call_record(open_call)
            open_call = None
    return calls


def _call_record(call: list[dict[str, Any]]) -> dict[str, float]:
    record = {"total_s": call[-1]["t"] - call[0]["t"]}
    for (_, phase), before, after in zip(BOUNDARIES[1:], call, call[1:]):
        record[f"{phase}_s"] = after["t"] - before["t"]
        for key in ("host_rss_bytes", "device_free_bytes"):
            if key in after:
                record[f"{phase}_{key}"] = after[key]
    if "device_free_bytes" in call[3] and "device_free_bytes" in call[4]:  # what the KV cache's wake took back
        record["kv_wake_took_bytes"] = call[3]["device_free_bytes"] - call[4]["device_free_bytes"]
    return record


def _host_rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _device_free_bytes() -> int | None:
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.mem_get_info()[0])


install()
