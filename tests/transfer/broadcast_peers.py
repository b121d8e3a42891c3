"""Broadcast receivers for tests: long-lived spawned processes that run one ``receive()`` per command.

A command is ``(rendezvous, secret, rank, mode, timeout_s, device, backend)``; the answer is ``(error type or None, message,
seconds, digests, weights_version)`` where digests map each name to (dtype, shape, sha256). Modes:
"ok"; "kill" (SIGKILL itself inside ``on_bucket`` of bucket 1: dies mid-broadcast); "kill-last" (the same inside
the last bucket's: the whole stream arrived, no status follows); "raise"
(``on_bucket`` raises at bucket 1). One receiver object is kept per (rendezvous, secret, rank), so
its weight version carries over from one command to the next, as in an engine. ``killed_sender_main`` is a
sender that dies mid-stream.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch

from tests.helpers import procs
from tests.transfer.peers import digest


def receiver_server_main(commands: Any, answers: Any) -> None:
    from refitkit.transfer._broadcast.receiver import BroadcastWeightReceiver

    receivers: dict[tuple, BroadcastWeightReceiver] = {}
    answers.put("ready")  # torch is imported: sessions are timed from here on
    while True:
        command = commands.get()
        if command is None:
            return
        rendezvous, secret, rank, mode, timeout_s, device, backend = command
        key = (rendezvous, secret, rank, device, backend)
        place = torch.device(device)
        if place.type == "cuda" and place.index is not None:
            torch.cuda.set_device(place)  # one GPU per rank (NCCL): this process's GPU
        got: dict[str, Any] = {}

        def on_bucket(weights: list, last: bool, state: dict = {"buckets": 0}) -> None:  # noqa: B006
            state["buckets"] += 1
            if (state["buckets"] == 2 and mode == "kill") or (last and mode == "kill-last"):
                os.kill(os.getpid(), signal.SIGKILL)
            if state["buckets"] == 2 and mode == "raise":
                raise RuntimeError("loader refused bucket 1 (test)")
            for name, tensor in weights:
                if tensor.device.type != place.type or place.index not in (None, tensor.device.index):
                    raise RuntimeError(f"{name!r} arrived on {tensor.device}, not on {device}")
                got[name] = digest(tensor)

        start = time.monotonic()
        try:
            receiver = receivers.get(key)
            if receiver is None:
                receiver = receivers[key] = BroadcastWeightReceiver(
                    rendezvous, secret=secret, rank=rank, device=device, backend=backend, timeout_s=timeout_s
                )
            receiver.receive(on_bucket)
            error = None, ""
        except Exception as exc:
            error = type(exc).__name__, str(exc)
        version = receivers[key].weights_version if key in receivers else None
        answers.put(
            (*error, time.monotonic() - start, got, None if version is None else (version.version, version.incomplete))
        )


class ReceiverProcess:
    """One spawned receiver server; ``start`` returns at once, ``result`` waits (bounded) for the outcome."""

    def __init__(self) -> None:
        ctx = procs.context()
        self.commands, self.answers = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=receiver_server_main, args=(self.commands, self.answers), daemon=True)
        self.process.start()
        ready = self.answers.get(timeout=120)  # a spawn imports torch: slow on a loaded box, once
        if ready != "ready":
            raise RuntimeError(f"receiver server said {ready!r} instead of ready")

    def start(
        self,
        rendezvous: str,
        secret: str,
        rank: int,
        mode: str = "ok",
        timeout_s: float = 3.0,
        device: str = "cpu",
        backend: str = "gloo",
    ) -> None:
        self.commands.put((rendezvous, secret, rank, mode, timeout_s, device, backend))

    def result(self, timeout_s: float = 60.0) -> tuple:
        return self.answers.get(timeout=timeout_s)

    def close(self) -> int | None:
        if self.process.is_alive():
            self.commands.put(None)
        self.process.join(30)
        if self.process.is_alive():  # only this test's own child, by its pid
            self.process.kill()
            self.process.join(10)
        return self.process.exitcode


def killed_sender_main(rendezvous: str, secret: str, bucket_bytes: int, kill_at_item: int, conn: Any) -> None:
    """A broadcast sender to one receiver that SIGKILLs itself while pulling item ``kill_at_item`` (the group is
    formed by then: the receiver is streaming)."""
    from refitkit.transfer._broadcast.sender import BroadcastWeightSender

    torch.set_num_threads(1)
    sender = BroadcastWeightSender(rendezvous, secret=secret, receivers=1, bucket_bytes=bucket_bytes, timeout_s=30)
    conn.send("up")

    def weights():
        for index in range(1000):
            if index == kill_at_item:
                os.kill(os.getpid(), signal.SIGKILL)
            yield f"s{index}", torch.full((3000,), float(index))

    sender.send(weights(), version=1)
