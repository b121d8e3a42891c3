"""The two sides of a verl weight sync, each in a spawned process, built the way verl's workers build a checkpoint
engine: ``import_external_libs(custom_backend_module)`` then ``CheckpointEngineRegistry.new(backend, ...)``
(``verl/workers/engine_workers.py`` for the trainer rank, ``verl/checkpoint_engine/base.py`` for the rollout rank).

The test process plays verl's manager: it takes each side's ``prepare()`` metadata, runs the backend's
``build_topology()`` and hands each side its ``init_process_group()`` keywords, every step, through a pipe.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch

BACKEND = "refitkit"
MODULE = "refitkit.integrations.verl"
PIPE_WAIT_S = 60.0  # what a peer waits for the test process's next word before giving up
STALL_S = 300.0  # a stalled peer sleeps this long: the test kills it long before


def make_engine(bucket_size: int, engine_kwargs: dict[str, Any], *, trainer: bool) -> Any:
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs(MODULE)
    if trainer:  # as ActorRolloutRefWorker.init_model does
        return CheckpointEngineRegistry.new(BACKEND, is_master=True, bucket_size=bucket_size, **engine_kwargs)
    return CheckpointEngineRegistry.new(BACKEND, bucket_size=bucket_size, **engine_kwargs)  # as CheckpointEngineWorker


def model_weights(step: int) -> list[tuple[str, torch.Tensor]]:
    """A small model's weights for ``step``: several dtypes, a 0-d tensor, odd sizes, special values, and one tensor
    larger than the tests' bucket (split across buckets on the wire)."""
    gen = torch.Generator().manual_seed(1000 + step)
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45, step], dtype=torch.float32)
    return [
        ("model.embed_tokens.weight", torch.randn(64, 48, generator=gen).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(48, 48, generator=gen)),
        ("model.layers.0.mlp.down_proj.weight", torch.randn(300, 200, generator=gen).to(torch.float16)),
        ("model.layers.0.input_layernorm.weight", special),
        ("model.rotary.position_ids", torch.arange(step, step + 40, dtype=torch.int64).reshape(1, 40)),
        ("model.quant.zero_point", torch.randint(-128, 127, (7,), generator=gen, dtype=torch.int8)),
        ("model.scale", torch.tensor(0.5 + step, dtype=torch.float32)),
        ("lm_head.weight", torch.randn(64, 48, generator=gen).to(torch.bfloat16)),
    ]


def error_record(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "mro": [cls.__name__ for cls in type(exc).__mro__],
        "message": str(exc),
        "notes": list(getattr(exc, "__notes__", [])),
    }


def _recv(pipe: Connection) -> Any:
    if not pipe.poll(PIPE_WAIT_S):
        raise TimeoutError(f"the test process said nothing for {PIPE_WAIT_S} s")
    return pipe.recv()


def _join_topology(engine: Any, pipe: Connection) -> None:
    pipe.send(("meta", engine.prepare()))
    engine.init_process_group(**_recv(pipe))


def _stream(step: int, stall_after: int | None, pipe: Connection) -> Iterator[tuple[str, torch.Tensor]]:
    for index, item in enumerate(model_weights(step)):
        if stall_after is not None and index == stall_after:
            pipe.send(("stalled", index))
            time.sleep(STALL_S)
        yield item


def trainer_main(
    pipe: Connection, steps: int, bucket_size: int, engine_kwargs: dict[str, Any], stall_after: int | None = None
) -> None:
    """One trainer rank: every step, join the topology and ``send_weights``; reports each step's metrics (and the
    channel's identity, to show it is kept across steps) or the error."""
    torch.set_num_threads(1)
    engine = make_engine(bucket_size, engine_kwargs, trainer=True)
    for step in range(steps):
        _join_topology(engine, pipe)
        try:
            metrics = asyncio.run(engine.send_weights(_stream(step, stall_after, pipe), global_steps=step))
        except Exception as exc:
            pipe.send(("error", error_record(exc)))
            return
        pipe.send(("sent", {"metrics": metrics, "channel": id(engine.channel), "pid": os.getpid()}))
        engine.finalize()
    engine.close()


async def _consume(engine: Any, step: int, stall_after: int | None, pipe: Connection) -> list[tuple[Any, ...]]:
    # verl's rollout adapters take the engine's weights through this helper (vLLM's and SGLang's senders)
    from verl.workers.rollout.utils import ensure_async_iterator

    received = []
    async for name, tensor in ensure_async_iterator(engine.receive_weights(global_steps=step)):
        if stall_after is not None and len(received) == stall_after:
            pipe.send(("stalled", len(received)))
            time.sleep(STALL_S)
        received.append(as_record(name, tensor))  # valid until the next is asked for: keep its bytes
    return received


def as_record(name: str, tensor: torch.Tensor) -> tuple[str, torch.dtype, tuple[int, ...], bytes]:
    """A received tensor as plain bytes (a tensor sent through a multiprocessing pipe would be shared by a file
    descriptor that dies with this process)."""
    raw = tensor.contiguous().reshape(-1).view(torch.uint8)
    return name, tensor.dtype, tuple(tensor.shape), bytes(raw.numpy().tobytes())


def from_record(record: tuple[str, torch.dtype, tuple[int, ...], bytes]) -> tuple[str, torch.Tensor]:
    name, dtype, shape, raw = record
    return name, torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)


def rollout_main(
    pipe: Connection, steps: int, bucket_size: int, engine_kwargs: dict[str, Any], stall_after: int | None = None
) -> None:
    """One rollout rank: every step, join the topology and take the weights from ``receive_weights``; reports what
    arrived or the error."""
    torch.set_num_threads(1)
    engine = make_engine(bucket_size, engine_kwargs, trainer=False)
    for step in range(steps):
        _join_topology(engine, pipe)
        try:
            received = asyncio.run(_consume(engine, step, stall_after, pipe))
        except Exception as exc:
            pipe.send(("error", error_record(exc)))
            return
        pipe.send(("received", {"weights": received, "channel": id(engine.channel)}))
        engine.finalize()
    engine.close()


BARRIER_TIMEOUT_S = 3.0
ABSENT_S = 10.0  # the absent rank stays away longer than the barrier's bound, then leaves


def barrier_rank(rank: int, world_size: int, absent_rank: int | None) -> dict[str, Any]:
    """A trainer rank of a gloo world: one barrier every rank reaches, then one ``absent_rank`` never reaches."""
    engine = make_engine(1 << 20, {"barrier_timeout_s": BARRIER_TIMEOUT_S}, trainer=True)
    engine.barrier("trainer offload")
    if rank == absent_rank:
        time.sleep(ABSENT_S)
        return {"absent": True}
    start = time.monotonic()
    try:
        waited_s = engine.barrier("trainer offload")
    except Exception as exc:
        return {"error": error_record(exc), "elapsed_s": time.monotonic() - start}
    finally:
        engine.close()
    return {"waited_s": waited_s}
