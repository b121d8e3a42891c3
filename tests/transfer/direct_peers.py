"""A toy engine with fused parameters and its own loader, and spawned broadcast receivers that load into it.

``ToyEngine`` stands in for an inference engine's model: q/k/v rows fused in ``qkv``, gate/up rows in
``gate_up``, a plain ``out`` and ``norm``, and ``w_t`` stored transposed (its loader writes the transpose,
so it can never land in place). ``toy_load_weights`` is its loader, converting dtypes as engines do.
A receiver server runs one ``receive()`` per command, with or without a load plan, and answers with the
digests of every engine parameter, the weight version and the ``DirectStats`` of the session.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tests.helpers import procs
from tests.transfer.peers import digest

HIDDEN, HEADS_Q, HEADS_KV, FFN = 32, 32, 16, 64


class ToyEngine(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(HEADS_Q + 2 * HEADS_KV, HIDDEN))
        self.gate_up = torch.nn.Parameter(torch.zeros(2 * FFN, HIDDEN))
        self.out = torch.nn.Parameter(torch.zeros(HIDDEN, HEADS_Q))
        self.norm = torch.nn.Parameter(torch.zeros(HIDDEN))
        self.w_t = torch.nn.Parameter(torch.zeros(HIDDEN, FFN))


ROWS = {
    "q": (0, HEADS_Q),
    "k": (HEADS_Q, HEADS_KV),
    "v": (HEADS_Q + HEADS_KV, HEADS_KV),
    "gate": (0, FFN),
    "up": (FFN, FFN),
}
SHAPES = {
    "q": (HEADS_Q, HIDDEN),
    "k": (HEADS_KV, HIDDEN),
    "v": (HEADS_KV, HIDDEN),
    "gate": (FFN, HIDDEN),
    "up": (FFN, HIDDEN),
    "out": (HIDDEN, HEADS_Q),
    "norm": (HIDDEN,),
    "w": (FFN, HIDDEN),
}


def toy_load_weights(engine: ToyEngine, weights: Any) -> None:
    """The toy engine's loader: fused rows, plain copies, one transpose; dtypes converted to the parameter's."""
    with torch.no_grad():
        for name, tensor in weights:
            if name in ("q", "k", "v", "gate", "up"):
                fused = engine.qkv if name in ("q", "k", "v") else engine.gate_up
                first, count = ROWS[name]
                fused.data[first : first + count].copy_(tensor)
            elif name == "w":
                engine.w_t.data.copy_(tensor.t())
            else:
                getattr(engine, name).data.copy_(tensor)


def toy_weights(seed: int, *, dtypes: dict[str, torch.dtype] | None = None) -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (name, torch.randn(shape, generator=generator).to((dtypes or {}).get(name, torch.float32)))
        for name, shape in SHAPES.items()
    ]


def engine_digests(engine: ToyEngine) -> dict[str, Any]:
    return {name: digest(param) for name, param in engine.named_parameters()}


def receiver_server_main(commands: Any, answers: Any, device: str) -> None:
    from refitkit.rollout.load_plan import record_load_plan
    from refitkit.transfer._broadcast.receiver import BroadcastWeightReceiver

    engine = ToyEngine().to(device)
    plan = record_load_plan(
        engine, lambda weights: toy_load_weights(engine, weights), [(n, s) for n, s in SHAPES.items()]
    )
    bound = plan.bind(engine)
    receivers: dict[tuple, BroadcastWeightReceiver] = {}
    answers.put("ready")
    while True:
        command = commands.get()
        if command is None:
            return
        rendezvous, secret, rank, use_plan, timeout_s = command
        with torch.no_grad():
            for param in engine.parameters():
                param.zero_()
        start = time.monotonic()
        key = (rendezvous, rank)
        try:
            receiver = receivers.get(key)
            if receiver is None:
                receiver = receivers[key] = BroadcastWeightReceiver(
                    rendezvous, secret=secret, rank=rank, device=device, timeout_s=timeout_s
                )
            receiver.receive(
                lambda weights, last: toy_load_weights(engine, weights), direct=bound if use_plan else None
            )
            error = None, ""
        except Exception as exc:
            error = type(exc).__name__, str(exc)
        receiver = receivers.get(key)
        version = None if receiver is None else receiver.weights_version
        direct = None if receiver is None or receiver.last_direct is None else receiver.last_direct
        answers.put(
            (
                *error,
                time.monotonic() - start,
                engine_digests(engine),
                None if version is None else (version.version, version.incomplete),
                None
                if direct is None
                else (direct.direct_bytes, direct.direct_tensors, direct.bucket_bytes, direct.fallbacks),
            )
        )


class DirectReceiverProcess:
    """One spawned toy-engine receiver; ``start`` returns at once, ``result`` waits (bounded) for the outcome."""

    def __init__(self, device: str = "cpu") -> None:
        ctx = procs.context()
        self.commands, self.answers = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=receiver_server_main, args=(self.commands, self.answers, device), daemon=True)
        self.process.start()
        ready = self.answers.get(timeout=120)
        if ready != "ready":
            raise RuntimeError(f"receiver server said {ready!r} instead of ready")

    def start(self, rendezvous: str, secret: str, rank: int, *, use_plan: bool, timeout_s: float = 5.0) -> None:
        self.commands.put((rendezvous, secret, rank, use_plan, timeout_s))

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
