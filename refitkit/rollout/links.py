"""The engine side of a refit cycle as one object: ``send(weights)`` tells the engine to receive, then streams.

``RefitCycle(adapter, link)`` calls ``link.send(adapter.named_weights())`` on the sending rank,
exactly as it calls a bare sender's ``send``. A bare ``BucketedWeightSender`` suits receivers that
wait on their own (a ``BucketedWeightReceiver`` loop); a vLLM engine must be told to receive, and a
broadcast needs a version per sync: the links below do both.

Versions: each ``send`` uses ``next_version`` (``first_version`` at the start, e.g. the step the
trainer resumes from) and then counts up by one, also after a failed sync, so a version never names
two different sets of weights.
"""

from __future__ import annotations

from typing import Any

from refitkit.errors import InvalidInput
from refitkit.rollout.vllm import VllmPushStats, push_weights, push_weights_broadcast
from refitkit.transfer.broadcast_sender import BroadcastWeightSender, checked_version
from refitkit.transfer.phases import TransferStats
from refitkit.transfer.sender import BucketedWeightSender


class VllmLink:
    """A vLLM ``LLM`` (running ``RefitWorkerExtension``) fed by a ``BucketedWeightSender`` (same host) or a
    ``BroadcastWeightSender`` (then ``secret`` is the job's secret and the workers join as ranks ``first_rank``..)."""

    def __init__(
        self, llm: Any, sender: BucketedWeightSender | BroadcastWeightSender, *, secret: str | bytes | None = None,
        first_rank: int = 1, first_version: int = 0, timeout_s: float | None = None,
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
        self.llm, self.sender, self.secret, self.first_rank, self.timeout_s = llm, sender, secret, first_rank, timeout_s
        self.next_version = checked_version(first_version)
        self.last_push: VllmPushStats | None = None

    def send(self, weights: Any) -> TransferStats:
        """Push ``weights`` into the engine as version ``next_version``; the sender's stats (the workers' in ``last_push``)."""
        version, self.next_version = self.next_version, self.next_version + 1
        if self.broadcast:
            pushed = push_weights_broadcast(
                self.llm, self.sender, weights, secret=self.secret, version=version,  # type: ignore[arg-type]
                first_rank=self.first_rank, timeout_s=self.timeout_s,
            )  # fmt: skip
        else:
            pushed = push_weights(self.llm, self.sender, weights, version=version, timeout_s=self.timeout_s)
        self.last_push = pushed
        return pushed.sender


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
