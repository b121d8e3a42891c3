"""The engine side of a refit cycle as one object: ``send(weights)`` tells the engine to receive, then streams.

``RefitCycle(adapter, link)`` calls ``link.send(adapter.named_weights())`` on the sending rank,
exactly as it calls a bare sender's ``send``. A bare ``BucketedWeightSender`` suits receivers that
wait on their own (a ``BucketedWeightReceiver`` loop); a vLLM or SGLang engine must be told to receive,
and a broadcast needs a version per sync: the links below do both.

Versions: each ``send`` uses ``next_version`` (``first_version`` at the start, e.g. the step the
trainer resumes from) and then counts up by one, also after a failed sync, so a version never names
two different sets of weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum
from typing import Any

from refitkit._knobs import checked_seconds
from refitkit.errors import EngineError, InvalidInput, KVCacheWontFit
from refitkit.rollout import _sglang_internals as sglang_internals
from refitkit.rollout import _vllm_internals as internals
from refitkit.rollout.sessions import bounded_call, checked_first_rank
from refitkit.rollout.sglang import SglangPushStats, checked_broadcast_ranks, engine_state, weights_discarded
from refitkit.rollout.sglang import push_weights as sglang_push_weights
from refitkit.rollout.sglang import push_weights_broadcast as sglang_push_weights_broadcast
from refitkit.rollout.vllm import VllmPushStats, push_weights, push_weights_broadcast
from refitkit.transfer import BroadcastWeightSender, BucketedWeightSender, TransferStats
from refitkit.transfer.common import checked_version


class EngineMemory(Enum):
    """Where a linked engine's memory is, as the link drove it."""

    SERVING = "serving"  # weights and KV cache resident
    ASLEEP = "asleep"  # weights and KV cache released (vLLM's LLM.sleep, SGLang's release_memory_occupation)
    WEIGHTS_AWAKE = "weights awake"  # weights back for a sync, KV cache still released


class VllmLink:
    """A vLLM ``LLM`` fed by a ``BucketedWeightSender`` (same host) or a ``BroadcastWeightSender`` (then ``secret`` is
    the job's secret and the workers join as ranks ``first_rank``..), and, with ``sleep_level``, its memory.

    The engine receives through ``RefitWorkerExtension`` (``worker_extension_cls``) or the ``refitkit``
    weight-transfer backend. With ``sleep_level`` (1 or 2; the engine made with ``enable_sleep_mode=True``)
    the link drives the engine's memory around a ``RefitCycle`` (which calls the three methods below on
    the sending rank): ``wake_for_sync`` before the weights stream (weights back), ``wake_for_rollout``
    after the cross-rank barrier (the KV cache back, refused with ``KVCacheWontFit`` when it cannot fit;
    the prefix cache is empty, as vLLM's sleep left it), ``sleep_for_training`` before the trainer's resume. Level 2 discards the
    weights (the engine is incomplete until a full sync lands): use 1 for LoRA or partial syncs. Every
    call is bounded by ``engine_timeout_s`` (``EngineTimeout``). Without ``sleep_level`` the link never
    sleeps or wakes the engine (drive it by hand); it still resets the prefix cache after every sync.

    vLLM in a process that has used CUDA, or only asked whether it exists (``torch.cuda.is_available()``,
    which refitkit does), must start its workers with ``VLLM_WORKER_MULTIPROC_METHOD=spawn``: with fork its
    engine core dies ("Cannot re-initialize CUDA in forked subprocess").
    """

    def __init__(
        self, llm: Any, sender: BucketedWeightSender | BroadcastWeightSender, *, secret: str | bytes | None = None,
        first_rank: int = 1, first_version: int = 0, timeout_s: float | None = None, sleep_level: int | None = None,
        engine_timeout_s: float = 120.0, kv_headroom_bytes: int = 256 << 20,
    ) -> None:  # fmt: skip
        if not callable(getattr(llm, "collective_rpc", None)):
            raise InvalidInput(f"VllmLink: llm must be a vllm.LLM (with collective_rpc), got a {type(llm).__name__}")
        self.broadcast = isinstance(sender, BroadcastWeightSender)
        if not self.broadcast and not isinstance(sender, BucketedWeightSender):
            raise InvalidInput(
                f"VllmLink: sender must be a BucketedWeightSender or a BroadcastWeightSender, got a {type(sender).__name__}"
            )
        if self.broadcast and secret is None:
            raise InvalidInput("VllmLink: a BroadcastWeightSender needs secret= (the job's secret, as given to the sender)")
        if sleep_level not in (None, 1, 2):
            raise InvalidInput(f"VllmLink: sleep_level={sleep_level!r}; need 1 (weights kept on the host), 2 (discarded) or None")
        if sleep_level is not None and not internals.sleep_mode_enabled(llm):
            raise InvalidInput("VllmLink: sleep_level needs an engine made with enable_sleep_mode=True (or pass sleep_level=None)")
        if isinstance(kv_headroom_bytes, bool) or not isinstance(kv_headroom_bytes, int) or kv_headroom_bytes < 0:
            raise InvalidInput(f"VllmLink: kv_headroom_bytes={kv_headroom_bytes!r}; need an int >= 0")
        self.llm, self.sender, self.secret, self.first_rank, self.timeout_s = llm, sender, secret, first_rank, timeout_s
        self.sleep_level, self.engine_timeout_s, self.kv_headroom_bytes = (
            sleep_level, checked_seconds(engine_timeout_s, "engine_timeout_s"), kv_headroom_bytes
        )
        self.next_version = checked_version(first_version)
        self.memory = EngineMemory.SERVING
        self.last_push: VllmPushStats | None = None
        self.call_seconds: dict[str, float] = {}  # each engine call's latest duration, e.g. "wake_up(tags=['kv_cache'])"

    @property
    def drives_memory(self) -> bool:
        """Whether ``RefitCycle`` should call the link's memory steps (it has a ``sleep_level``)."""
        return self.sleep_level is not None

    def send(self, weights: Any) -> TransferStats:
        """Push ``weights`` into the engine as version ``next_version``; the sender's stats (the workers' in ``last_push``).

        A driven engine that sleeps gets its weights woken first; a push into an engine put to sleep by
        hand is refused (``EngineAsleep``) before any byte lands."""
        self.wake_for_sync()
        version, self.next_version = self.next_version, self.next_version + 1
        reset = self.memory is EngineMemory.SERVING  # cached KV of the old weights is stale (queued behind the push)
        if self.broadcast:
            pushed = push_weights_broadcast(
                self.llm, self.sender, weights, secret=self.secret, version=version,  # type: ignore[arg-type]
                first_rank=self.first_rank, timeout_s=self.timeout_s, reset_prefix_cache=reset,
            )  # fmt: skip
        else:
            pushed = push_weights(self.llm, self.sender, weights, version=version, timeout_s=self.timeout_s, reset_prefix_cache=reset)
        self.last_push = pushed
        return pushed.sender

    # -- the engine's memory around a refit cycle -------------------------------------------------

    def wake_for_sync(self) -> None:
        """Weights back on the device for a sync (a no-op unless the link put the engine to sleep)."""
        if self.memory is EngineMemory.ASLEEP:
            self._bounded("wake_up(tags=['weights'])", lambda: self.llm.wake_up(tags=["weights"]))
            self.memory = EngineMemory.WEIGHTS_AWAKE

    def wake_for_rollout(self) -> None:
        """The KV cache back once every trainer rank freed its memory; ``KVCacheWontFit`` (naming the bytes needed
        and free) instead of an out-of-memory inside vLLM, the engine left as it was.

        The prefix cache is fresh without a reset of ours: only the link's own ``sleep`` (level 1 or 2) leads
        here, and vLLM's sleep clears the prefix cache and holds the scheduler until every tag is awake
        (``EngineCore.sleep`` → ``pause_scheduler(clear_cache=True)`` in 0.25.0, GPU-tested in
        ``test_vllm_prefix_cache.py``), so nothing was cached under the old weights."""
        if self.memory is EngineMemory.ASLEEP:
            self.wake_for_sync()
        if self.memory is not EngineMemory.WEIGHTS_AWAKE:
            return
        for rank, state in enumerate(self._bounded("refit_memory", lambda: self.llm.collective_rpc("refit_memory"))):
            needed = int(state["asleep"].get("kv_cache", 0))
            if needed + self.kv_headroom_bytes > state["free_bytes"]:
                raise KVCacheWontFit(
                    f"waking vLLM worker {rank}'s KV cache needs {needed / 2**20:.0f} MiB (+ kv_headroom_bytes="
                    f"{self.kv_headroom_bytes / 2**20:.0f} MiB) but its device has {state['free_bytes'] / 2**20:.0f} MiB free: "
                    "the trainer still holds memory (offload and flush_device first, or lower gpu_memory_utilization); "
                    "the engine's weights stay awake, its KV cache asleep",
                    needed_bytes=needed, free_bytes=int(state["free_bytes"]),
                )  # fmt: skip
        self._bounded("wake_up(tags=['kv_cache'])", lambda: self.llm.wake_up(tags=["kv_cache"]))
        self.memory = EngineMemory.SERVING

    def sleep_for_training(self) -> None:
        """Release the engine's memory before the trainer's state comes back (``sleep_level``; a no-op without it)."""
        if self.sleep_level is None or self.memory is EngineMemory.ASLEEP:
            return
        self._bounded(f"sleep(level={self.sleep_level})", lambda: self.llm.sleep(level=self.sleep_level))
        self.memory = EngineMemory.ASLEEP
        if self.sleep_level == 2:  # the weights are gone until the next full sync
            self._bounded("refit_weights_discarded", lambda: self.llm.collective_rpc("refit_weights_discarded"))

    def _bounded(self, what: str, call: Callable[[], Any]) -> Any:
        return bounded_engine_call(
            "vLLM", what, call, timeout_s=self.engine_timeout_s, memory=self.memory, call_seconds=self.call_seconds
        )  # fmt: skip


class SglangLink:
    """An ``sglang.Engine`` (refitkit's plugin installed, one data-parallel replica) fed by a ``BucketedWeightSender``
    (same host, TP=1) or a ``BroadcastWeightSender`` (any TP size: every scheduler joins, as ranks ``first_rank`` ..
    ``first_rank + tp_size - 1`` of the sender's ``receivers``; then ``secret`` is the job's secret), and, with
    ``release_memory``, its memory.

    GPU-tested with SGLang 0.5.17 (``docs/sglang.md``). With ``release_memory=True`` (the engine made
    with ``enable_memory_saver=True``) the link drives the engine's memory around a ``RefitCycle``, like ``VllmLink``:
    ``wake_for_sync`` resumes the weights before they stream, ``wake_for_rollout`` (after the cross-rank barrier)
    resumes the KV cache and CUDA graphs, refused with ``KVCacheWontFit`` when the device lacks the KV cache's bytes
    plus ``kv_headroom_bytes`` (which covers the CUDA graphs: SGLang does not report their size), and
    ``sleep_for_training`` releases everything, refused with ``EngineError`` while a request is in flight (SGLang's
    release asserts idleness and would kill the engine). Without ``enable_weights_cpu_backup`` the released weights
    are discarded: the engine reports them incomplete until a full sync lands. Every call is bounded by
    ``engine_timeout_s`` (``EngineTimeout``); no generation may be started while the memory is released.
    """

    def __init__(
        self, engine: Any, sender: BucketedWeightSender | BroadcastWeightSender, *, secret: str | bytes | None = None,
        first_rank: int = 1, first_version: int = 0, timeout_s: float | None = None, release_memory: bool = False,
        engine_timeout_s: float = 120.0, kv_headroom_bytes: int = 256 << 20,
    ) -> None:  # fmt: skip
        if not sglang_internals.is_engine(engine):
            raise InvalidInput(
                f"SglangLink: engine must be an sglang.Engine (with update_weights_from_ipc and the memory calls), got a "
                f"{type(engine).__name__}"
            )
        self.broadcast = isinstance(sender, BroadcastWeightSender)
        if not self.broadcast and not isinstance(sender, BucketedWeightSender):
            raise InvalidInput(
                f"SglangLink: sender must be a BucketedWeightSender or a BroadcastWeightSender, got a {type(sender).__name__}"
            )
        if self.broadcast and secret is None:
            raise InvalidInput("SglangLink: a BroadcastWeightSender needs secret= (the job's secret, as given to the sender)")
        if not isinstance(release_memory, bool):
            raise InvalidInput(f"SglangLink: release_memory={release_memory!r}; need a bool")
        if isinstance(kv_headroom_bytes, bool) or not isinstance(kv_headroom_bytes, int) or kv_headroom_bytes < 0:
            raise InvalidInput(f"SglangLink: kv_headroom_bytes={kv_headroom_bytes!r}; need an int >= 0")
        settings = sglang_internals.engine_settings(engine)
        if settings["dp_size"] != 1 or settings["pp_size"] != 1:
            raise InvalidInput(
                f"SglangLink: dp_size={settings['dp_size']}, pp_size={settings['pp_size']}; the link drives one data-parallel "
                "replica of one pipeline stage (SGLang's weight update from IPC serves dp_size=1): one link per replica"
            )
        if settings["tp_size"] != 1 and not self.broadcast:
            raise InvalidInput(
                f"SglangLink: tp_size={settings['tp_size']} with a BucketedWeightSender, which feeds one scheduler; give "
                f"a BroadcastWeightSender(receivers={settings['tp_size']}): every TP rank joins the broadcast"
            )
        if self.broadcast:
            checked_broadcast_ranks(settings["tp_size"], checked_first_rank(first_rank), sender.receivers, "SglangLink")  # type: ignore[union-attr]
        if release_memory and not settings["memory_saver"]:
            raise InvalidInput(
                "SglangLink: release_memory needs an engine made with enable_memory_saver=True (without it SGLang's "
                "release frees nothing); or pass release_memory=False"
            )
        self.engine, self.sender, self.secret, self.first_rank, self.timeout_s = engine, sender, secret, first_rank, timeout_s
        self.release_memory, self.weights_kept = release_memory, settings["weights_cpu_backup"]
        self.engine_timeout_s, self.kv_headroom_bytes = checked_seconds(engine_timeout_s, "engine_timeout_s"), kv_headroom_bytes
        self.next_version = checked_version(first_version)
        self.memory = EngineMemory.SERVING
        self.last_push: SglangPushStats | None = None
        self.call_seconds: dict[str, float] = {}  # each engine call's latest duration, e.g. "resume_memory_occupation(['weights'])"

    @property
    def drives_memory(self) -> bool:
        """Whether ``RefitCycle`` should call the link's memory steps (``release_memory``)."""
        return self.release_memory

    def send(self, weights: Any) -> TransferStats:
        """Push ``weights`` into the engine as version ``next_version``; the sender's stats (the scheduler's in ``last_push``).

        Released weights are resumed first when the link released them; a push into weights released by hand is
        refused (``EngineAsleep``) before any byte lands. SGLang flushes its prefix cache after the sync while the
        KV cache is resident (releasing it flushed it already)."""
        self.wake_for_sync()
        version, self.next_version = self.next_version, self.next_version + 1
        flush = self.memory is EngineMemory.SERVING
        if self.broadcast:
            pushed = sglang_push_weights_broadcast(
                self.engine, self.sender, weights, secret=self.secret, version=version,  # type: ignore[arg-type]
                first_rank=self.first_rank, timeout_s=self.timeout_s, flush_cache=flush,
            )  # fmt: skip
        else:
            pushed = sglang_push_weights(self.engine, self.sender, weights, version=version, timeout_s=self.timeout_s, flush_cache=flush)
        self.last_push = pushed
        return pushed.sender

    # -- the engine's memory around a refit cycle -------------------------------------------------

    def wake_for_sync(self) -> None:
        """Weights back on the device for a sync (a no-op unless the link released them)."""
        if self.memory is EngineMemory.ASLEEP:
            self._bounded("resume_memory_occupation(['weights'])", lambda: sglang_internals.resume_memory(self.engine, ["weights"]))
            self.memory = EngineMemory.WEIGHTS_AWAKE

    def wake_for_rollout(self) -> None:
        """The KV cache and CUDA graphs back once every trainer rank freed its memory; ``KVCacheWontFit`` (naming the
        bytes needed and free) instead of an out-of-memory inside SGLang, the engine left as it was."""
        if self.memory is EngineMemory.ASLEEP:
            self.wake_for_sync()
        if self.memory is not EngineMemory.WEIGHTS_AWAKE:
            return
        state = self._bounded("state query", lambda: engine_state(self.engine, timeout_s=self.engine_timeout_s))
        for rank, found in enumerate(state.get("tp_ranks", [state])):  # each TP rank's KV cache on its own device
            needed, free = int(found["kv_cache_bytes"]), int(found["free_bytes"])
            if needed + self.kv_headroom_bytes > free:
                raise KVCacheWontFit(
                    f"resuming SGLang's KV cache needs {needed / 2**20:.0f} MiB (+ kv_headroom_bytes="
                    f"{self.kv_headroom_bytes / 2**20:.0f} MiB for CUDA graphs and slack) but the device of TP rank {rank} "
                    f"({found['device']}) has {free / 2**20:.0f} MiB free: the trainer still holds memory (offload and "
                    "flush_device first, or lower mem_fraction_static); the engine's weights stay resident, its KV cache "
                    "released",
                    needed_bytes=needed, free_bytes=free,
                )  # fmt: skip
        tags = ["kv_cache", "cuda_graph"]  # both released by sleep_for_training; the KV cache was flushed then
        self._bounded(f"resume_memory_occupation({tags})", lambda: sglang_internals.resume_memory(self.engine, tags))
        self.memory = EngineMemory.SERVING

    def sleep_for_training(self) -> None:
        """Release the engine's memory before the trainer's state comes back (``release_memory``; a no-op without it)."""
        if not self.release_memory or self.memory is EngineMemory.ASLEEP:
            return
        if self.memory is EngineMemory.WEIGHTS_AWAKE:  # a cycle that failed before the rollout: KV cache still released
            tags = ["weights"]
        else:
            state = self._bounded("state query", lambda: engine_state(self.engine, timeout_s=self.engine_timeout_s))
            if not state["idle"] or state["released"]:
                raise EngineError(
                    f"SglangLink: cannot release SGLang's memory now (idle={state['idle']}, already released: "
                    f"{state['released']}): SGLang's release asserts an idle engine and a second release of a tag kills "
                    "it; finish or abort the rollout's requests, and leave release/resume to the link"
                )
            tags = ["weights", "kv_cache", "cuda_graph"]
        self._bounded(f"release_memory_occupation({tags})", lambda: sglang_internals.release_memory(self.engine, tags))
        self.memory = EngineMemory.ASLEEP
        if not self.weights_kept:  # no host backup: the weights are garbage until the next full sync
            self._bounded("weights_discarded", lambda: weights_discarded(self.engine, timeout_s=self.engine_timeout_s))

    def _bounded(self, what: str, call: Callable[[], Any]) -> Any:
        return bounded_engine_call(
            "SGLang", what, call, timeout_s=self.engine_timeout_s, memory=self.memory, call_seconds=self.call_seconds
        )  # fmt: skip


class BroadcastLink:
    """Bare ``BroadcastWeightReceiver``s (engine workers that call ``receive`` themselves): versions counted here."""

    def __init__(self, sender: BroadcastWeightSender, *, first_version: int = 0) -> None:
        if not isinstance(sender, BroadcastWeightSender):
            raise InvalidInput(f"BroadcastLink: sender must be a BroadcastWeightSender, got a {type(sender).__name__}")
        self.sender = sender
        self.next_version = checked_version(first_version)

    def send(self, weights: Any) -> TransferStats:
        """Broadcast ``weights`` as version ``next_version``; returns once every receiver loaded them."""
        version, self.next_version = self.next_version, self.next_version + 1
        return self.sender.send(weights, version=version)


def bounded_engine_call(
    engine: str, what: str, call: Callable[[], Any], *, timeout_s: float, memory: EngineMemory,
    call_seconds: dict[str, float],
) -> Any:  # fmt: skip
    """``call()`` in a helper thread, at most ``timeout_s`` (``engine_timeout_s``); its duration goes into
    ``call_seconds[what]``; an engine's error becomes an ``EngineError`` naming it and the engine's ``memory``."""
    began = time.perf_counter()
    result = bounded_call(
        call, timeout_s=timeout_s, what=f"{engine}'s {what}", context=f" (engine memory: {memory.value})",
        within=f"engine_timeout_s={timeout_s:g} (raise it if the engine is only slow)",
    )  # fmt: skip
    call_seconds[what] = time.perf_counter() - began
    return result
