"""refitkit as a verl checkpoint-engine backend: ``checkpoint_engine.backend=refitkit``, selected by configuration.

verl 0.9.1 builds its checkpoint engine by name from ``CheckpointEngineRegistry`` after importing
``checkpoint_engine.custom_backend_module`` in every worker (``verl/workers/engine_workers.py`` for the trainer ranks,
``verl/checkpoint_engine/base.py`` for the rollout side and the driver's manager). Naming the package
``refitkit.integrations.verl`` there registers ``RefitkitCheckpointEngine`` under ``"refitkit"``::

    actor_rollout_ref.rollout.checkpoint_engine.backend=refitkit
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=refitkit.integrations.verl
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.refitkit.timeout_s=60

Each trainer rank's half is a ``SenderChannel``, each rollout rank's a ``ReceiverChannel`` (refitkit's one-host
channel: shared memory or CUDA IPC, every wait bounded, a dead peer noticed by its connection). Rollout rank ``j`` is
paired with trainer rank ``j`` on the same host; trainer ranks without a rollout rank still consume their weights
(an FSDP or Megatron engine's ``get_per_tensor_param()`` gathers collectively: every rank must walk it). The pairing
and each side's endpoint are the metadata verl's manager passes from ``prepare()`` through ``build_topology()`` to
``init_process_group()``; the channels stay open across steps (a step's ``finalize()`` holds no bucket memory: the
sender frees its bucket before ``send()`` returns) until ``close()``.

Failures are refitkit's errors, raised in verl's ``send_weights`` / ``receive_weights`` with a note naming the
backend and its knobs, so verl's step fails with refitkit's message instead of waiting.

This module never imports verl (the engine is duck-typed); the package's ``register()`` does, with verl installed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from refitkit._knobs import checked_seconds
from refitkit.errors import InvalidInput, RefitError
from refitkit.ranks import RankGroup
from refitkit.transfer import ReceiverChannel, SenderChannel
from refitkit.transfer.common import checked_knobs

log = logging.getLogger(__name__)

BACKEND = "refitkit"
KNOBS = f"actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.{BACKEND}"  # where a verl user sets ours


class Role(enum.Enum):
    """What ``init_process_group()`` made this engine: nothing yet, a trainer rank's sender, a rollout rank's
    receiver."""

    UNSET = "unset"
    TRAINER = "trainer"
    ROLLOUT = "rollout"


@dataclass(frozen=True)
class RankInfo:
    """What ``prepare()`` reports for one rank: its host, and the endpoint it binds should it be a paired trainer."""

    host: str
    endpoint: str

    def as_metadata(self) -> dict[str, str]:
        return {"host": self.host, "endpoint": self.endpoint}

    @classmethod
    def from_metadata(cls, raw: Any, index: int) -> RankInfo:
        if (
            not isinstance(raw, dict)
            or not isinstance(raw.get("host"), str)
            or not isinstance(raw.get("endpoint"), str)
        ):
            raise InvalidInput(
                f"{BACKEND} checkpoint engine: metadata[{index}] is {raw!r}; build_topology() takes what each "
                "rank's prepare() returned (a dict with 'host' and 'endpoint')"
            )
        return cls(host=raw["host"], endpoint=raw["endpoint"])


def _checked_bucket_size(bucket_size: object) -> int:
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0:
        raise InvalidInput(
            f"{BACKEND} checkpoint engine: bucket_size={bucket_size!r}; verl passes "
            "checkpoint_engine.update_weights_bucket_megabytes << 20, a positive int of bytes"
        )
    return bucket_size


def _checked_device_name(device: object) -> str:
    if device == "auto":
        return device
    try:
        torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError) as exc:
        raise InvalidInput(f"{KNOBS}.device={device!r}: need 'auto' or a torch device name ('cuda', 'cpu')") from exc
    return device  # type: ignore[return-value]


def _receiver_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


class RefitkitCheckpointEngine:
    """verl's checkpoint engine (its ``CheckpointEngine`` interface, duck-typed so this module loads without verl)
    whose trainer half is a ``SenderChannel`` and whose rollout half is a ``ReceiverChannel``.

    ``bucket_size`` and ``is_master`` are what verl passes every backend; the rest come from
    ``engine_kwargs.refitkit``: ``timeout_s`` bounds each wait for the peer, ``max_sync_s`` one whole sync on the
    rollout side, ``transport`` is the sender's (``"auto"``, ``"shm"``, ``"cuda_ipc"``), ``device`` where the rollout
    side's tensors arrive (``"auto"``: this process's GPU, else the CPU), ``direct`` the sender's one-copy mode,
    ``barrier_timeout_s`` the bound of ``barrier()`` across the trainer ranks, ``phase_timeout_s`` the colocated
    manager's bound on its other phases (``RefitkitCheckpointManager``: the wakes and the trainer offload).
    """

    wire_format = "named_tensors"  # how verl's CheckpointEngineWorker hands our weights to its rollout adapter

    def __init__(
        self,
        bucket_size: int,
        is_master: bool = False,
        *,
        timeout_s: float = 120.0,
        max_sync_s: float | None = None,
        transport: str = "auto",
        device: str = "auto",
        direct: bool = True,
        barrier_timeout_s: float = 300.0,
        phase_timeout_s: float = 600.0,
    ) -> None:
        # checked here, when verl builds the engine from its config, not at the first sync
        self.bucket_size = _checked_bucket_size(bucket_size)
        self.is_master = is_master
        self.timeout_s, _, self.transport = checked_knobs(timeout_s=timeout_s, transport=transport)
        self.max_sync_s = None if max_sync_s is None else checked_seconds(max_sync_s, f"{KNOBS}.max_sync_s")
        self.barrier_timeout_s = checked_seconds(barrier_timeout_s, f"{KNOBS}.barrier_timeout_s")
        self.phase_timeout_s = checked_seconds(phase_timeout_s, f"{KNOBS}.phase_timeout_s")
        self.device = _checked_device_name(device)
        if not isinstance(direct, bool):
            raise InvalidInput(f"{KNOBS}.direct={direct!r}: need true or false")
        self.direct = direct
        self.role = Role.UNSET
        self.info = RankInfo(host=socket.gethostname(), endpoint=f"verl-{os.getpid()}-{secrets.token_hex(6)}")
        self._endpoint: str | None = None  # the endpoint of this rank's pair (None: a trainer rank without one)
        self._sender: SenderChannel | None = None
        self._receiver: ReceiverChannel | None = None
        # The receiver's waits block: they run on this one thread (a ZMQ socket stays on one thread), never on the
        # event loop of the Ray actor that awaits receive_weights().
        self._pull: concurrent.futures.ThreadPoolExecutor | None = None
        self._ranks: RankGroup | None = None  # the trainer ranks' own gloo group, made by the first barrier()

    @property
    def channel(self) -> SenderChannel | ReceiverChannel | None:
        """This rank's open channel (its ``last_timings_s`` has the last sync's phases); None before
        ``init_process_group()``, after ``close()``, and on a trainer rank without a rollout rank."""
        return self._open_channel()

    # -- verl's topology calls --------------------------------------------------------------------

    def prepare(self) -> dict[str, str]:
        """This rank's host and endpoint, for ``build_topology()`` (the same every step: the pairing is kept)."""
        return self.info.as_metadata()

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Pair rollout rank ``j`` with trainer rank ``j`` (same host); ``metadata`` is the trainer ranks' then the
        rollout ranks' ``prepare()``, as verl's manager gathers them. Returns each side's ``init_process_group``
        keywords, one list entry per rank."""
        for knob, value in (("actor_wg_world_size", actor_wg_world_size), ("rollout_world_size", rollout_world_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInput(f"{BACKEND} checkpoint engine: {knob}={value!r}; need a positive int")
        if not isinstance(metadata, (list, tuple)) or len(metadata) != actor_wg_world_size + rollout_world_size:
            raise InvalidInput(
                f"{BACKEND} checkpoint engine: got {len(metadata) if isinstance(metadata, (list, tuple)) else metadata!r}"
                f" metadata entries for {actor_wg_world_size} trainer and {rollout_world_size} rollout ranks"
            )
        if rollout_world_size > actor_wg_world_size:
            raise InvalidInput(
                f"{BACKEND} checkpoint engine pairs each rollout rank with one trainer rank on its host: "
                f"{rollout_world_size} rollout ranks but {actor_wg_world_size} trainer ranks; use a rollout world no "
                "larger than the trainer's, or checkpoint_engine.backend=nccl across hosts"
            )
        infos = [RankInfo.from_metadata(raw, index) for index, raw in enumerate(metadata)]
        trainers, rollouts = infos[:actor_wg_world_size], infos[actor_wg_world_size:]
        for rank, (trainer, rollout) in enumerate(zip(trainers, rollouts)):
            if trainer.host != rollout.host:
                raise InvalidInput(
                    f"{BACKEND} checkpoint engine: rollout rank {rank} is on host {rollout.host!r} but its trainer "
                    f"rank {rank} on {trainer.host!r}; refitkit's channel joins ranks of one host (shared memory or "
                    "CUDA IPC): place them together, or use checkpoint_engine.backend=nccl across hosts"
                )
        actor_kwargs = {
            "role": [Role.TRAINER.value] * actor_wg_world_size,
            "endpoint": [
                trainer.endpoint if rank < rollout_world_size else None for rank, trainer in enumerate(trainers)
            ],
        }
        rollout_kwargs = {
            "role": [Role.ROLLOUT.value] * rollout_world_size,
            "endpoint": [trainers[rank].endpoint for rank in range(rollout_world_size)],
        }
        return actor_kwargs, rollout_kwargs

    def init_process_group(self, *, role: str, endpoint: str | None) -> None:
        """Open this rank's end of its pair (kept when the pairing is the last step's)."""
        try:
            new_role = Role(role)
        except ValueError:
            raise InvalidInput(
                f"{BACKEND} checkpoint engine: role={role!r}; build_topology() gives 'trainer' or 'rollout'"
            ) from None
        if new_role is Role.UNSET or (new_role is Role.ROLLOUT and endpoint is None):
            raise InvalidInput(f"{BACKEND} checkpoint engine: role={role!r} with endpoint={endpoint!r}")
        if new_role is self.role and endpoint == self._endpoint and self._open_channel() is not None:
            return
        self._close_channel()
        if new_role is Role.TRAINER and endpoint is not None:
            self._sender = SenderChannel(
                endpoint,
                bucket_bytes=self.bucket_size,
                transport=self.transport,
                timeout_s=self.timeout_s,
                direct=self.direct,
            )
        elif new_role is Role.ROLLOUT:
            extra = {} if self.max_sync_s is None else {"max_sync_s": self.max_sync_s}
            self._receiver = ReceiverChannel(endpoint, _receiver_device(self.device), self.timeout_s, **extra)
            self._pull = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="refitkit-verl")
        self.role, self._endpoint = new_role, endpoint

    def finalize(self) -> None:
        """End of a step. The channel stays open for the next (it holds no bucket memory between syncs)."""

    def close(self) -> None:
        """Close this rank's channel (``init_process_group()`` opens a new one) and its barrier's rank group."""
        self._close_channel()
        ranks, self._ranks = self._ranks, None
        if ranks is not None:
            ranks.close()

    def _close_channel(self) -> None:
        sender, receiver, pull = self._sender, self._receiver, self._pull
        self._sender = self._receiver = self._pull = None
        self.role, self._endpoint = Role.UNSET, None
        if sender is not None:
            sender.close()
        if receiver is not None:
            receiver.close()
        if pull is not None:
            pull.shutdown(wait=True)  # its one job, if any, is bounded by the receiver's waits

    # -- the sync ---------------------------------------------------------------------------------

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, float]:
        """Stream ``(name, tensor)`` pairs to this rank's rollout rank; returns the sync's figures (verl's manager
        merges them into its step metrics). A trainer rank without a rollout rank walks its weights and sends
        nothing. A sync generator is walked on the calling thread, as verl's own path does (its gathers are
        collectives of the training engine)."""
        self._require(Role.TRAINER, "send_weights")
        if self._sender is None:
            await _drain(weights)
            return {}
        try:
            if hasattr(weights, "__aiter__"):
                stats = await self._sender.asend(weights)
            else:
                stats = self._sender.send(weights)
        except RefitError as exc:
            exc.add_note(self._note("send_weights", global_steps))
            raise
        return {
            f"{BACKEND}/sync_s": stats.seconds,
            f"{BACKEND}/sync_bytes": float(stats.bytes),
            f"{BACKEND}/sync_gbps": stats.gbps,
        }

    async def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """The paired trainer rank's ``(name, tensor)`` pairs, one sync; each tensor is valid until the next is
        asked for (copy what you keep: verl's rollout adapters copy each into their own bucket)."""
        receiver = self._require(Role.ROLLOUT, "receive_weights")
        pull = self._pull
        if not isinstance(receiver, ReceiverChannel) or pull is None:
            raise RefitError(f"{BACKEND} checkpoint engine: receive_weights() on a closed engine")
        loop = asyncio.get_running_loop()
        weights = receiver.iter_weights()
        try:
            while True:
                try:
                    item = await loop.run_in_executor(pull, _next_or_none, weights)
                except RefitError as exc:  # the session ended with it: released, and reported to the sender
                    exc.add_note(self._note("receive_weights", global_steps))
                    raise
                if item is None:
                    return
                yield item
        finally:
            # Ended early (the consumer failed or stopped, or this task was cancelled): close the session on its own
            # thread, which releases it and tells the sender. A session that ended already is closed as a no-op.
            await loop.run_in_executor(pull, weights.close)

    # -- across the trainer ranks ------------------------------------------------------------------

    def barrier(self, phase: str = "trainer offload") -> float:
        """Wait until every trainer rank got here, at most ``barrier_timeout_s``; returns the seconds waited.

        For the colocated loop's last step before the rollout engine wakes its KV cache: verl calls it on every
        trainer rank through ``execute_checkpoint_engine``. It runs on refitkit's own gloo group over the trainer's
        default group, made at the first call (collective), never on the trainer's NCCL group, whose timed-out wait
        takes the process down. A rank that does not arrive makes every other raise ``BarrierTimeout``."""
        try:
            if self._ranks is None:
                self._ranks = RankGroup(timeout_s=self.barrier_timeout_s, phase=phase)
            return self._ranks.barrier(phase)
        except RefitError as exc:
            exc.add_note(
                f"verl checkpoint engine {BACKEND!r}, barrier() after {phase}: bound {KNOBS}.barrier_timeout_s="
                f"{self.barrier_timeout_s:g}"
            )
            raise

    # -- helpers ----------------------------------------------------------------------------------

    def _open_channel(self) -> SenderChannel | ReceiverChannel | None:
        return self._sender if self.role is Role.TRAINER else self._receiver

    def _require(self, role: Role, call: str) -> SenderChannel | ReceiverChannel | None:
        if self.role is not role:
            raise RefitError(
                f"{BACKEND} checkpoint engine: {call}() on a rank whose role is {self.role.value!r} (needs "
                f"{role.value!r}); verl calls init_process_group() with build_topology()'s keywords first"
            )
        return self._open_channel()

    def _note(self, call: str, global_steps: int | None) -> str:
        step = "" if global_steps is None else f" at global step {global_steps}"
        return (
            f"verl checkpoint engine {BACKEND!r}, {call}(){step} on the {self.role.value} side of {self._endpoint!r}: "
            f"bounds are {KNOBS}.timeout_s={self.timeout_s:g} (each wait for the peer) and {KNOBS}.max_sync_s "
            "(one whole sync)"
        )


def _next_or_none(weights: Iterator[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor] | None:
    return next(weights, None)


async def _drain(weights: Any) -> None:
    if hasattr(weights, "__aiter__"):
        async for _ in weights:
            pass
    else:
        for _ in weights:
            pass


__all__ = ["BACKEND", "KNOBS", "RefitkitCheckpointEngine", "Role"]
