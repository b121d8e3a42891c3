"""Everything of SGLang's that refitkit touches, in one place. Checked against SGLang 0.5.17 (the wheel of
``../shared/gpu-wheels``, read from its source; torch_memory_saver 0.0.10). Run on one H200 with that
wheel (``tests/engines/sglang``, 2026-12-03); SGLang has no CPU build. Paths below are relative to ``sglang/srt/`` in that wheel.

The route (see ``docs/dev/sglang-internals.md``):

- refitkit's ``sglang.srt.plugins`` entry point (group name: ``plugins/__init__.py:29``) runs in every SGLang
  process, in each scheduler before the ``Scheduler`` is built (``load_plugins()`` at
  ``managers/scheduler.py:4895``), and registers an AROUND hook (``plugins/hook_registry.py:84``,
  wrapper ``:386``) on ``SchedulerWeightUpdaterManager.update_weights_from_ipc``
  (``managers/scheduler_components/weight_updater.py:168``). ``load_plugins`` then applies it by
  ``setattr`` on the class (a plain class attribute, allowed on a slots dataclass); the dispatcher binds
  the method when the Scheduler is built (``managers/scheduler.py:1540``), so it binds ours.
- The trainer calls ``Engine.update_weights_from_ipc(zmq_handles={REQUEST_KEY: json}, flush_cache=...)``
  (``entrypoints/engine.py:1418``): only strings. The tokenizer takes the model-update writer lock
  (``managers/tokenizer_control_mixin.py:551``; every generate request holds the reader lock for its whole
  life, so the sync waits for in-flight requests and new ones wait for it) and returns the scheduler's
  ``(success, message)`` (``:530-562``). SGLang pickles that control message itself (``SGLANG_USE_PICKLE_IPC``
  defaults on, ``environ.py:285``); refitkit's own wire carries no pickle.
- The hook handles requests carrying ``REQUEST_KEY`` and hands every other one (checkpoint-engine's) to
  SGLang's own method. It reads: ``offload_tags`` (the tags released, ``:85``), the model runner
  (``tp_worker.model_runner``: ``.model`` ``model_runner.py:1063``, ``.gpu_id`` ``:286``, ``.ps`` ``:289``,
  ``.model_config`` ``:290``), ``draft_worker``, ``is_fully_idle`` (``scheduler.py:3967``), the KV cache's
  size as ``get_internal_state`` reads it (``scheduler.py:4172``), and after a sync calls SGLang's own
  ``flush_cache_after_weight_update`` (``:103``) and the TP barrier (as ``:179`` does).
- Memory: ``Engine.release_memory_occupation(tags)`` / ``resume_memory_occupation(tags)``
  (``entrypoints/engine.py:1527/1533`` → ``weight_updater.py:202/248``), tags ``"weights"``,
  ``"kv_cache"``, ``"cuda_graph"`` (``constants.py:2-4``). They take no lock; a release asserts the engine
  is idle (``:203``) and a resume of a tag not released is a KeyError (``:255``): either kills the
  scheduler, so the link checks first. Releasing ``kv_cache`` flushes the cache after pausing it
  (``:230-231``), so SGLang's flush is safe while the KV cache is released.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("refitkit.rollout.sglang")

SGLANG_VERSION = "0.5.17"
HOOK_TARGET = (
    "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager.update_weights_from_ipc"
)
REQUEST_KEY = "refitkit"  # the zmq_handles key of a refitkit request (checkpoint-engine's keys are "GPU-<uuid>")
WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"  # constants.py:2-4


# -- inside each scheduler process --------------------------------------------------------------------


def register_update_hook(handle: Callable[[Any, Any, Any], Any]) -> None:
    """Register ``handle(original, updater, recv_req)`` AROUND SGLang's scheduler-side ``update_weights_from_ipc``;
    ``load_plugins`` applies it after every plugin ran (``plugins/__init__.py:103-140``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, handle, HookType.AROUND)


def request_text(recv_req: Any) -> str | None:
    """The refitkit request in an ``UpdateWeightsFromIPCReqInput`` (``io_struct.py:1744``), None for anyone else's."""
    handles = getattr(recv_req, "zmq_handles", None)
    return handles.get(REQUEST_KEY) if isinstance(handles, dict) else None


def update_output(success: bool, message: str) -> Any:
    """What SGLang's handler returns (``UpdateWeightsFromIPCReqOutput``, ``io_struct.py:1755``)."""
    from sglang.srt.managers.io_struct import UpdateWeightsFromIPCReqOutput

    return UpdateWeightsFromIPCReqOutput(success=success, message=message)


def scheduler_model(updater: Any) -> torch.nn.Module:
    """The scheduler's live model (``tp_worker.model_runner.model``)."""
    return updater.tp_worker.model_runner.model


def scheduler_device(updater: Any) -> torch.device:
    """The scheduler's GPU (``model_runner.gpu_id``; ``torch.cuda.set_device`` was called with it, ``model_runner.py:352``)."""
    return torch.device("cuda", int(updater.tp_worker.model_runner.gpu_id))


def tp_rank_and_size(updater: Any) -> tuple[int, int]:
    """This scheduler's tensor-parallel rank and the TP size (``model_runner.ps``)."""
    ps = updater.tp_worker.model_runner.ps
    return int(ps.tp_rank), int(ps.tp_size)


def released_tags(updater: Any) -> list[str]:
    """The memory tags released by ``release_memory_occupation`` and not resumed yet (``offload_tags``), sorted."""
    return sorted(updater.offload_tags)


def has_draft_model(updater: Any) -> bool:
    """Whether speculative decoding runs a draft model (SGLang's own handler updates it too: ``weight_updater.py:173``)."""
    return updater.draft_worker is not None


def is_idle(updater: Any) -> bool:
    """No request queued, running or in flight (what ``release_memory_occupation`` asserts)."""
    return bool(updater.is_fully_idle())


def kv_cache_bytes(updater: Any) -> int:
    """The KV cache pool's bytes as SGLang reports them (``get_internal_state``, ``scheduler.py:4172``: GB of 2**30)."""
    scheduler = updater.scheduler
    if scheduler is None:
        return 0
    return int(float(scheduler.token_to_kv_pool_allocator.get_kvcache().mem_usage) * (1 << 30))


def checkpoint_of(updater: Any) -> tuple[str, str | None, bool]:
    """The checkpoint the engine loaded: path (or hub id), revision, and whether it ties ``lm_head`` to the embedding."""
    config = updater.tp_worker.model_runner.model_config
    tied = bool(getattr(config.hf_config, "tie_word_embeddings", False))
    return str(config.model_path), getattr(config, "revision", None), tied


def flush_after_update(updater: Any, recv_req: Any) -> None:
    """SGLang's own cache flush after a weight update (``flush_cache=True`` in the request; it asserts it flushed)."""
    updater.flush_cache_after_weight_update(recv_req)


def tp_barrier(updater: Any) -> None:
    """The barrier SGLang's own handler ends with, over the TP CPU (gloo) group."""
    torch.distributed.barrier(group=updater.tp_cpu_group)


def tp_replies(updater: Any, reply: str, gather: Callable[[Any, str], list[str]]) -> list[str]:
    """Every TP rank's ``reply`` in rank order (``gather`` over the TP CPU group; only TP rank 0's output reaches the
    tokenizer, ``scheduler.py:1862``); ``[reply]`` under TP=1."""
    if tp_rank_and_size(updater)[1] == 1:
        return [reply]
    return gather(updater.tp_cpu_group, reply)


# -- in the trainer's process (the Engine's) -----------------------------------------------------------


def is_engine(engine: Any) -> bool:
    """An ``sglang.Engine`` (offline engine: it has the IPC update and the memory calls)."""
    return all(
        callable(getattr(engine, name, None))
        for name in ("update_weights_from_ipc", "release_memory_occupation", "resume_memory_occupation")
    )


def engine_settings(engine: Any) -> dict[str, Any]:
    """What the link checks before driving the engine (``Engine.server_args``, ``entrypoints/engine.py:236``)."""
    args = engine.server_args
    return {
        "tp_size": int(getattr(args, "tp_size", 1)),
        "dp_size": int(getattr(args, "dp_size", 1)),
        "pp_size": int(getattr(args, "pp_size", 1)),
        "memory_saver": bool(getattr(args, "enable_memory_saver", False)),
        "weights_cpu_backup": bool(getattr(args, "enable_weights_cpu_backup", False)),
    }


def call_update(engine: Any, request: str, *, flush_cache: bool) -> tuple[bool, str]:
    """``Engine.update_weights_from_ipc`` with one refitkit request: ``(success, message)`` from TP rank 0.

    It blocks on the engine's own event loop with no bound of its own: the caller bounds it."""
    success, message = engine.update_weights_from_ipc(zmq_handles={REQUEST_KEY: request}, flush_cache=flush_cache)
    return bool(success), str(message)


def release_memory(engine: Any, tags: list[str]) -> None:
    """``Engine.release_memory_occupation(tags)``; the engine must be idle."""
    engine.release_memory_occupation(tags=tags)


def resume_memory(engine: Any, tags: list[str]) -> None:
    """``Engine.resume_memory_occupation(tags)``; every tag must be released."""
    engine.resume_memory_occupation(tags=tags)
