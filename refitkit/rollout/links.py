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
from typing import Any, ClassVar

from refitkit._knobs import checked_seconds, renamed_knob
from refitkit.errors import EngineError, InvalidInput, KVCacheWontFit, LinkClosed
from refitkit.rollout import _sglang_internals as sglang_internals
from refitkit.rollout import _vllm_internals as internals
from refitkit.rollout._push import PushStats
from refitkit.rollout.sessions import HelperThreads, bounded_call, checked_first_rank
from refitkit.rollout.sglang import checked_broadcast_ranks, checked_engine, engine_state, weights_discarded
from refitkit.rollout.sglang import push_weights_broadcast_with as sglang_push_weights_broadcast_with
from refitkit.rollout.sglang import push_weights_with as sglang_push_weights_with
from refitkit.rollout.vllm import push_weights_broadcast_with, push_weights_with
from refitkit.transfer import BroadcastWeightSender, BucketedWeightSender, TransferStats
from refitkit.transfer.common import checked_version


class EngineMemory(Enum):
    """Where a linked engine's memory is, as the link drove it."""

    SERVING = "serving"  # weights and KV cache resident
    ASLEEP = "asleep"  # weights and KV cache released (vLLM's LLM.sleep, SGLang's release_memory_occupation)
    WEIGHTS_AWAKE = "weights awake"  # weights back for a sync, KV cache still released


class _EngineLink:
    """What every engine's link shares: the sender (same host, or a broadcast whose ``secret`` is the job's secret and
    whose engine ranks join as ``first_rank``..), the versions, ``send``, the bounded engine calls and the helper
    threads they run on (the link's own, kept for its life: ``close()`` or ``with`` ends them; the sender and the
    engine stay the caller's); the memory steps (``wake_for_sync``, ``wake_for_rollout``, ``sleep_for_training``) are
    each engine's. A closed link, or one used in another process than the one that made it (a forked child), raises
    ``LinkClosed``."""

    engine_name: ClassVar[str]  # in messages
    # the engine's two pushes, on the link's helper threads (their knobs are the same on every engine)
    push: ClassVar[Callable[..., PushStats]]
    push_broadcast: ClassVar[Callable[..., PushStats]]

    def __init__(
        self,
        link: str,
        engine: Any,
        sender: BucketedWeightSender | BroadcastWeightSender,
        *,
        secret: str | bytes | None,
        first_rank: int,
        first_version: int,
        timeout_s: float | None,
        sleep_level: int | None,
        engine_timeout_s: float,
        kv_headroom_bytes: int,
    ) -> None:
        if sleep_level not in (None, 1, 2):
            raise InvalidInput(
                f"{link}: sleep_level={sleep_level!r}; need 1 (weights kept on the host), 2 (discarded) or None"
            )
        self.broadcast = isinstance(sender, BroadcastWeightSender)
        if not self.broadcast and not isinstance(sender, BucketedWeightSender):
            raise InvalidInput(
                f"{link}: sender must be a BucketedWeightSender or a BroadcastWeightSender, got a {type(sender).__name__}"
            )
        if self.broadcast and secret is None:
            raise InvalidInput(
                f"{link}: a BroadcastWeightSender needs secret= (the job's secret, as given to the sender)"
            )
        if isinstance(kv_headroom_bytes, bool) or not isinstance(kv_headroom_bytes, int) or kv_headroom_bytes < 0:
            raise InvalidInput(f"{link}: kv_headroom_bytes={kv_headroom_bytes!r}; need an int >= 0")
        self.sender, self.secret, self.first_rank, self.timeout_s = (
            sender,
            secret,
            checked_first_rank(first_rank),
            timeout_s,
        )
        self.sleep_level, self._engine = sleep_level, engine
        self.engine_timeout_s = checked_seconds(engine_timeout_s, "engine_timeout_s")
        self.kv_headroom_bytes = kv_headroom_bytes
        self.next_version = checked_version(first_version)
        self.memory = EngineMemory.SERVING
        self.last_push: PushStats | None = None
        self.call_seconds: dict[
            str, float
        ] = {}  # each engine call's latest duration, e.g. "wake_up(tags=['kv_cache'])"
        self._helpers = HelperThreads(link)  # made last: a refused argument leaves nothing to close

    def close(self) -> None:
        """End the link's helper threads (an engine call stuck past its bound is logged and left to end on its own);
        the sender and the engine stay as they are. Closing twice is fine; a closed link raises ``LinkClosed``."""
        self._helpers.close()

    def __enter__(self) -> _EngineLink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def drives_memory(self) -> bool:
        """Whether ``RefitCycle`` should call the link's memory steps (it has a ``sleep_level``)."""
        return self.sleep_level is not None

    def send(self, weights: Any) -> TransferStats:
        """Push ``weights`` into the engine as version ``next_version``; the sender's stats (the engine ranks' in
        ``last_push``).

        Weights the link put to sleep are woken first; a push into weights put to sleep by hand is refused
        (``EngineAsleep``) before any byte lands. The prefix cache is reset after the push while the KV cache is
        resident (a sleep emptied it already)."""
        self._helpers.check_usable()
        self.wake_for_sync()
        version, self.next_version = self.next_version, self.next_version + 1
        reset = self.memory is EngineMemory.SERVING  # cached KV of the old weights is stale (queued behind the push)
        if self.broadcast:
            pushed = self.push_broadcast(
                self._helpers,
                self._engine,
                self.sender,
                weights,
                secret=self.secret,
                version=version,  # type: ignore[arg-type]
                first_rank=self.first_rank,
                timeout_s=self.timeout_s,
                reset_prefix_cache=reset,
            )
        else:
            pushed = self.push(
                self._helpers,
                self._engine,
                self.sender,
                weights,
                version=version,
                timeout_s=self.timeout_s,
                reset_prefix_cache=reset,
            )
        self.last_push = pushed
        return pushed.sender

    def wake_for_sync(self) -> None:
        """Weights back on the device for a sync (each engine's own calls)."""
        raise NotImplementedError

    def _bounded(self, what: str, call: Callable[[], Any]) -> Any:
        return bounded_engine_call(
            self.engine_name,
            what,
            call,
            timeout_s=self.engine_timeout_s,
            memory=self.memory,
            call_seconds=self.call_seconds,
            helpers=self._helpers,
        )

    def _kv_cache_fits(self, needed: int, free: int, *, what: str, knob: str, kept: str) -> None:
        """``KVCacheWontFit`` unless ``needed`` bytes plus ``kv_headroom_bytes`` fit in ``free``."""
        if needed + self.kv_headroom_bytes > free:
            raise KVCacheWontFit(
                f"{what} needs {needed / 2**20:.0f} MiB (+ kv_headroom_bytes={self.kv_headroom_bytes / 2**20:.0f} MiB) but "
                f"its device has {free / 2**20:.0f} MiB free: the trainer still holds memory (offload and flush_device "
                f"first, or lower {knob}); {kept}",
                needed_bytes=needed,
                free_bytes=free,
            )


class VllmLink(_EngineLink):
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

    engine_name = "vLLM"
    push = staticmethod(push_weights_with)
    push_broadcast = staticmethod(push_weights_broadcast_with)

    def __init__(
        self,
        llm: Any,
        sender: BucketedWeightSender | BroadcastWeightSender,
        *,
        secret: str | bytes | None = None,
        first_rank: int = 1,
        first_version: int = 0,
        timeout_s: float | None = None,
        sleep_level: int | None = None,
        engine_timeout_s: float = 120.0,
        kv_headroom_bytes: int = 256 << 20,
    ) -> None:
        if not callable(getattr(llm, "collective_rpc", None)):
            raise InvalidInput(f"VllmLink: llm must be a vllm.LLM (with collective_rpc), got a {type(llm).__name__}")
        super().__init__(
            "VllmLink",
            llm,
            sender,
            secret=secret,
            first_rank=first_rank,
            first_version=first_version,
            timeout_s=timeout_s,
            sleep_level=sleep_level,
            engine_timeout_s=engine_timeout_s,
            kv_headroom_bytes=kv_headroom_bytes,
        )
        if sleep_level is not None and not internals.sleep_mode_enabled(llm):
            raise InvalidInput(
                "VllmLink: sleep_level needs an engine made with enable_sleep_mode=True (or pass sleep_level=None)"
            )
        self.llm = llm

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
            self._kv_cache_fits(
                int(state["asleep"].get("kv_cache", 0)),
                int(state["free_bytes"]),
                what=f"waking vLLM worker {rank}'s KV cache",
                knob="gpu_memory_utilization",
                kept="the engine's weights stay awake, its KV cache asleep",
            )
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


class SglangLink(_EngineLink):
    """An ``sglang.Engine`` (refitkit's plugin installed, one data-parallel replica) fed by a ``BucketedWeightSender``
    (same host, TP=1) or a ``BroadcastWeightSender`` (any TP size: every scheduler joins, as ranks ``first_rank`` ..
    ``first_rank + tp_size - 1`` of the sender's ``receivers``; then ``secret`` is the job's secret), and, with
    ``sleep_level``, its memory.

    GPU-tested with SGLang 0.5.17 (``docs/sglang.md``). With ``sleep_level`` (the engine made with
    ``enable_memory_saver=True``) the link drives the engine's memory around a ``RefitCycle``, like ``VllmLink``:
    ``wake_for_sync`` resumes the weights before they stream, ``wake_for_rollout`` (after the cross-rank barrier)
    resumes the KV cache and CUDA graphs, refused with ``KVCacheWontFit`` when the device lacks the KV cache's bytes
    plus ``kv_headroom_bytes`` (which covers the CUDA graphs: SGLang does not report their size), and
    ``sleep_for_training`` releases everything, refused with ``EngineError`` while a request is in flight (SGLang's
    release asserts idleness and would kill the engine). The level says what happens to the weights, as for vLLM, and
    must be what the engine does: 1 keeps them on the host (``enable_weights_cpu_backup=True``), 2 discards them (no
    backup: the engine reports them incomplete until a full sync lands). Every call is bounded by
    ``engine_timeout_s`` (``EngineTimeout``); no generation may be started while the memory is released.
    ``release_memory=True`` is the former spelling of a ``sleep_level``, still taken for one release.
    """

    engine_name = "SGLang"
    push = staticmethod(sglang_push_weights_with)
    push_broadcast = staticmethod(sglang_push_weights_broadcast_with)

    def __init__(
        self,
        engine: Any,
        sender: BucketedWeightSender | BroadcastWeightSender,
        *,
        secret: str | bytes | None = None,
        first_rank: int = 1,
        first_version: int = 0,
        timeout_s: float | None = None,
        sleep_level: int | None = None,
        engine_timeout_s: float = 120.0,
        kv_headroom_bytes: int = 256 << 20,
        release_memory: bool | None = None,
    ) -> None:
        settings = checked_engine(engine, "SglangLink")
        kept = settings["weights_cpu_backup"]
        if release_memory is not None and not isinstance(release_memory, bool):
            raise InvalidInput(f"SglangLink: release_memory={release_memory!r}; need a bool (or, better, sleep_level=)")
        sleep_level = renamed_knob(
            "sleep_level",
            sleep_level,
            default=None,
            old="release_memory",
            old_value=release_memory,
            converted=lambda release: (1 if kept else 2) if release else None,
        )
        super().__init__(
            "SglangLink",
            engine,
            sender,
            secret=secret,
            first_rank=first_rank,
            first_version=first_version,
            timeout_s=timeout_s,
            sleep_level=sleep_level,
            engine_timeout_s=engine_timeout_s,
            kv_headroom_bytes=kv_headroom_bytes,
        )
        if settings["tp_size"] != 1 and not self.broadcast:
            raise InvalidInput(
                f"SglangLink: tp_size={settings['tp_size']} with a BucketedWeightSender, which feeds one scheduler; give "
                f"a BroadcastWeightSender(receivers={settings['tp_size']}): every TP rank joins the broadcast"
            )
        if self.broadcast:
            checked_broadcast_ranks(settings["tp_size"], self.first_rank, sender.receivers, "SglangLink")  # type: ignore[union-attr]
        if sleep_level is not None and not settings["memory_saver"]:
            raise InvalidInput(
                "SglangLink: sleep_level needs an engine made with enable_memory_saver=True (without it SGLang's "
                "release frees nothing); or pass sleep_level=None"
            )
        if sleep_level is not None and (sleep_level == 1) != kept:
            raise InvalidInput(
                f"SglangLink: sleep_level={sleep_level} but this engine {'keeps' if kept else 'discards'} its released "
                f"weights (enable_weights_cpu_backup={kept}): pass sleep_level={1 if kept else 2}, or make the engine "
                f"with enable_weights_cpu_backup={not kept}"
            )
        self.engine = engine

    # -- the engine's memory around a refit cycle -------------------------------------------------

    def wake_for_sync(self) -> None:
        """Weights back on the device for a sync (a no-op unless the link released them)."""
        if self.memory is EngineMemory.ASLEEP:
            self._bounded(
                "resume_memory_occupation(['weights'])",
                lambda: sglang_internals.resume_memory(self.engine, ["weights"]),
            )
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
            self._kv_cache_fits(
                int(found["kv_cache_bytes"]),
                int(found["free_bytes"]),
                what=f"resuming the KV cache of SGLang's TP rank {rank} ({found['device']}; the headroom covers CUDA graphs)",
                knob="mem_fraction_static",
                kept="the engine's weights stay resident, its KV cache released",
            )
        tags = ["kv_cache", "cuda_graph"]  # both released by sleep_for_training; the KV cache was flushed then
        self._bounded(f"resume_memory_occupation({tags})", lambda: sglang_internals.resume_memory(self.engine, tags))
        self.memory = EngineMemory.SERVING

    def sleep_for_training(self) -> None:
        """Release the engine's memory before the trainer's state comes back (``sleep_level``; a no-op without it)."""
        if self.sleep_level is None or self.memory is EngineMemory.ASLEEP:
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
        if self.sleep_level == 2:  # no host backup: the weights are garbage until the next full sync
            self._bounded("weights_discarded", lambda: weights_discarded(self.engine, timeout_s=self.engine_timeout_s))


class BroadcastLink:
    """Bare ``BroadcastWeightReceiver``s (engine workers that call ``receive`` themselves): versions counted here."""

    def __init__(self, sender: BroadcastWeightSender, *, first_version: int = 0) -> None:
        if not isinstance(sender, BroadcastWeightSender):
            raise InvalidInput(f"BroadcastLink: sender must be a BroadcastWeightSender, got a {type(sender).__name__}")
        self.sender = sender
        self.next_version = checked_version(first_version)
        self.closed = False

    def send(self, weights: Any) -> TransferStats:
        """Broadcast ``weights`` as version ``next_version``; returns once every receiver loaded them."""
        if self.closed:
            raise LinkClosed("BroadcastLink is closed: make a new BroadcastLink to send again")
        version, self.next_version = self.next_version, self.next_version + 1
        return self.sender.send(weights, version=version)

    def close(self) -> None:
        """Refuse further sends (``LinkClosed``); the sender stays the caller's. Closing twice is fine."""
        self.closed = True

    def __enter__(self) -> BroadcastLink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def bounded_engine_call(
    engine: str,
    what: str,
    call: Callable[[], Any],
    *,
    timeout_s: float,
    memory: EngineMemory,
    call_seconds: dict[str, float],
    helpers: HelperThreads,
) -> Any:
    """``call()`` in one of ``helpers``, at most ``timeout_s`` (``engine_timeout_s``); its duration goes into
    ``call_seconds[what]``; an engine's error becomes an ``EngineError`` naming it and the engine's ``memory``."""
    began = time.perf_counter()
    result = bounded_call(
        call,
        timeout_s=timeout_s,
        what=f"{engine}'s {what}",
        context=f" (engine memory: {memory.value})",
        within=f"engine_timeout_s={timeout_s:g} (raise it if the engine is only slow)",
        helpers=helpers,
    )
    call_seconds[what] = time.perf_counter() - began
    return result
