"""The Ray side of the colocated-manager tests: trainer ranks in verl's own ``RayWorkerGroup`` and rollout servers.

A trainer rank is a verl ``Worker`` whose ``update_weights`` and ``execute_checkpoint_engine`` are verl's own
``ActorRolloutRefWorker`` methods (the same functions, with their dispatch registrations); its checkpoint engine is
built as ``ActorRolloutRefWorker.init_model`` builds one, and its training engine is refitkit's ``FSDPAdapter`` over a
small model behind verl's engine calls (``get_per_tensor_param``, ``is_param_offload_enabled``, ``to``). What is not
verl's: the training engine (verl's FSDP engine needs a model checkpoint and a GPU for its sync) and the rollout
server, which stands in for verl's ``vLLMHttpServer`` (no vLLM in this venv): its ``collective_rpc("refit_receive")``
receives through refitkit's ``ReceiverChannel`` as refitkit's vLLM worker extension does, and it logs each call.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker

BUCKET_BYTES = 64 << 10


def model_weights(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7 + step)
    return {
        "model.embed_tokens.weight": torch.randn(64, 48, generator=gen).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(300, 200, generator=gen),
        "model.norm.weight": torch.randn(48, generator=gen).to(torch.float16),
    }


def digest(named: dict[str, torch.Tensor] | list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    items = named.items() if isinstance(named, dict) else named
    return {
        name: f"{t.dtype}:{tuple(t.shape)}:{hashlib.sha256(t.contiguous().view(torch.uint8).numpy()).hexdigest()}"
        for name, t in items
    }


class SmallModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name, tensor in model_weights(0).items():
            self.register_parameter(name.replace(".", "_"), torch.nn.Parameter(tensor.clone()))
        self.names = list(model_weights(0))


class AdapterEngine:
    """A training engine as verl's worker calls it, its offload and reload refitkit's ``FSDPAdapter``."""

    is_param_offload_enabled = True

    def __init__(self) -> None:
        from refitkit.engines.fsdp import FSDPAdapter

        self.model = SmallModel()
        self.adapter = FSDPAdapter(self.model)

    def train_step(self, step: int) -> None:
        """What a step leaves behind: new weights, on the device (the adapter reloads them first)."""
        self.adapter.reload()
        with torch.no_grad():
            for name, tensor in model_weights(step).items():
                getattr(self.model, name.replace(".", "_")).copy_(tensor)

    def get_per_tensor_param(self, **_: Any) -> tuple[Any, None]:
        params = ((name, getattr(self.model, name.replace(".", "_")).detach()) for name in self.model.names)
        return params, None

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        if device == "cpu":
            self.adapter.offload(model=model, optimizer=False, grad=grad)
        else:
            self.adapter.reload(model=model, optimizer=False, grad=grad)


@dataclass
class _Actor:
    engine: AdapterEngine


class TrainerRank(Worker):
    """A verl trainer rank with verl's own weight-sync methods."""

    update_weights = ActorRolloutRefWorker.update_weights
    execute_checkpoint_engine = ActorRolloutRefWorker.execute_checkpoint_engine

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self, engine_kwargs: dict[str, Any]) -> int:
        import torch.distributed as dist
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        import_external_libs("refitkit.integrations.verl")  # checkpoint_engine.custom_backend_module
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            "refitkit", is_master=dist.get_rank() == 0, bucket_size=BUCKET_BYTES, **engine_kwargs
        )
        self.actor = _Actor(AdapterEngine())
        self.offloaded_at: float | None = None
        return dist.get_rank()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_step(self, step: int) -> dict[str, str]:
        self.actor.engine.train_step(step)
        return digest(model_weights(step))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def model_state(self) -> dict[str, Any]:
        adapter = self.actor.engine.adapter
        return {"model": adapter.part_states.model.name, "host_bytes": adapter.state_bytes().model.host_bytes}


def rollout_server_class() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class RolloutServer:
        """Stands in for verl's ``vLLMHttpServer`` (its ``wake_up(tags)``, ``sleep()``, ``collective_rpc``)."""

        def __init__(self, stall_after: int | None = None, stall_s: float = 0.0) -> None:
            torch.set_num_threads(1)
            self.log: list[tuple[str, Any, float]] = []
            self.received: dict[str, str] = {}
            self.stall_after, self.stall_s = stall_after, stall_s
            self.channel: Any = None  # kept across steps, as refitkit's vLLM worker extension keeps its receiver

        def wake_up(self, tags: list[str] | None = None) -> None:
            self.log.append(("wake_up", list(tags or []), time.time()))

        def sleep(self) -> None:
            self.log.append(("sleep", None, time.time()))

        def collective_rpc(
            self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
        ) -> None:
            from refitkit.transfer import ReceiverChannel

            kwargs = kwargs or {}
            if method != "refit_receive":
                raise ValueError(f"unknown method {method!r}")
            endpoint = kwargs["endpoint"].format(rank=0)
            self.log.append(("receive", endpoint, time.time()))
            if self.channel is None:
                self.channel = ReceiverChannel(endpoint, torch.device("cpu"), kwargs["timeout_s"])
            received = []
            try:
                for index, (name, tensor) in enumerate(self.channel.iter_weights()):
                    if self.stall_after is not None and index == self.stall_after:
                        self.stall_after = None  # once: the next attempt syncs
                        time.sleep(self.stall_s)
                    received.append((name, tensor.clone()))
            except Exception as exc:
                self.log.append(("receive_failed", type(exc).__name__, time.time()))
                self.channel.close()
                self.channel = None
                raise
            self.received = digest(received)
            self.log.append(("received", len(received), time.time()))

        def state(self) -> dict[str, Any]:
            return {"log": self.log, "received": self.received, "pid": os.getpid()}

    return RolloutServer
