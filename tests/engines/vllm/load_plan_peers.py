"""vLLM's own Llama model class, built directly in a spawned process, as a broadcast receiver with a load plan.

On CPU a live ``LLM`` repacks its linear weights after loading (``dispatch_cpu_unquantized_gemm`` drops
``layer.weight``), so there is no plain parameter memory to land in there; the plan is taken, and the
stream received, on ``LlamaForCausalLM`` of vLLM instantiated from the checkpoint's engine config,
whose parameters and ``load_weights`` are the ones the engine loads through before that post-processing.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from typing import Any

import torch

from tests.transfer.peers import digest


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def build_vllm_llama(checkpoint: str) -> tuple[Any, Any]:
    """vLLM's LlamaForCausalLM for ``checkpoint`` (float32, world size 1 over gloo) and its config context."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.llama import LlamaForCausalLM

    config = EngineArgs(model=checkpoint, dtype="float32", enforce_eager=True, max_model_len=128).create_engine_config()
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
        )
        ensure_model_parallel_initialized(1, 1)
        return LlamaForCausalLM(vllm_config=config), config


def server_main(checkpoint: str, commands: Any, answers: Any) -> None:
    from transformers import LlamaForCausalLM as HFLlama
    from vllm.config import set_current_vllm_config

    from refitkit.rollout.load_plan import record_load_plan
    from refitkit.transfer._broadcast.receiver import BroadcastWeightReceiver

    model, config = build_vllm_llama(checkpoint)
    shapes = [(name, tuple(tensor.shape)) for name, tensor in HFLlama.from_pretrained(checkpoint).state_dict().items()]
    with set_current_vllm_config(config):
        plan = record_load_plan(model, model.load_weights, shapes)
    bound = plan.bind(model)
    answers.put(
        ("ready", {name: tuple(dest.__dict__.values()) for name, dest in plan.destinations.items()}, dict(plan.skipped))
    )
    receivers: dict[str, BroadcastWeightReceiver] = {}
    while True:
        command = commands.get()
        if command is None:
            return
        rendezvous, secret, use_plan, timeout_s = command
        with torch.no_grad():
            for param in model.parameters():
                param.zero_()
        start = time.monotonic()
        try:
            receiver = receivers.get(rendezvous) or BroadcastWeightReceiver(
                rendezvous, secret=secret, rank=1, timeout_s=timeout_s
            )
            receivers[rendezvous] = receiver
            with set_current_vllm_config(config):
                receiver.receive(lambda weights, last: model.load_weights(weights), direct=bound if use_plan else None)
            error = None, ""
            direct = receiver.last_direct
            split = None if direct is None else (direct.direct_bytes, direct.bucket_bytes, direct.fallbacks)
        except Exception as exc:
            error, split = (type(exc).__name__, str(exc)), None
        digests = {name: digest(param) for name, param in model.named_parameters()}
        answers.put((*error, time.monotonic() - start, digests, split))


class VllmModelProcess:
    """The spawned model server; the constructor waits (bounded) until the model is built and its plan taken."""

    def __init__(self, checkpoint: str) -> None:
        ctx = mp.get_context("spawn")
        self.commands, self.answers = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=server_main, args=(checkpoint, self.commands, self.answers), daemon=True)
        self.process.start()
        ready, self.destinations, self.skipped = self.answers.get(timeout=240)
        if ready != "ready":
            raise RuntimeError(f"model server said {ready!r} instead of ready")

    def receive(self, rendezvous: str, secret: str, *, use_plan: bool, timeout_s: float = 30.0) -> None:
        self.commands.put((rendezvous, secret, use_plan, timeout_s))

    def result(self, timeout_s: float = 120.0) -> tuple:
        return self.answers.get(timeout=timeout_s)

    def close(self) -> int | None:
        if self.process.is_alive():
            self.commands.put(None)
        self.process.join(30)
        if self.process.is_alive():  # only this test's own child, by its pid
            self.process.kill()
            self.process.join(10)
        return self.process.exitcode
