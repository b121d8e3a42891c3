"""refitkit as verl 0.9.1's checkpoint-engine backend ``refitkit``, selected by configuration alone.

Real verl code throughout: the backend is registered by importing it with verl's ``import_external_libs`` and built by
verl's ``CheckpointEngineRegistry`` from verl's own ``CheckpointEngineConfig``; the topology comes from the backend's
``build_topology()`` over each side's ``prepare()``, as verl's manager gathers them; the rollout side is consumed
through verl's ``ensure_async_iterator`` as its rollout adapters consume a checkpoint engine. Trainer and rollout are
two real processes on the shm transport.
"""

from __future__ import annotations

import asyncio
import inspect
import multiprocessing as mp
import os
import signal
import socket
import time
from typing import Any

import pytest
import torch

from refitkit.errors import InvalidInput, RefitError
from tests.engines.verl import peers
from tests.helpers.bits import bits_equal

pytestmark = pytest.mark.timeout(240)

BUCKET = 64 << 10  # 64 KiB: the 120 KB down_proj is split across buckets
KWARGS = {"timeout_s": 60.0, "transport": "shm", "device": "cpu"}  # engine_kwargs.refitkit
START_S = 120.0  # a spawned peer imports verl (~7 s alone on the 2-core box; two at once, and beside other suites)
NOTICED_S = 5.0  # a killed peer is noticed by its connection within 1 s; the rest is slack for a loaded box
TIMEOUT_S = KWARGS["timeout_s"]  # what a killed peer must NOT be noticed by


@pytest.fixture(scope="module")
def registry() -> Any:
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs(peers.MODULE)
    return CheckpointEngineRegistry


class Pair:
    """One trainer rank and one rollout rank in spawned processes; this process plays verl's manager."""

    def __init__(
        self, registry: Any, steps: int, *, trainer_stall: int | None = None, rollout_stall: int | None = None
    ):
        ctx = mp.get_context("spawn")
        self.backend = registry.get(peers.BACKEND)
        self.trainer_pipe, trainer_end = ctx.Pipe()
        self.rollout_pipe, rollout_end = ctx.Pipe()
        self.trainer = ctx.Process(
            target=peers.trainer_main, args=(trainer_end, steps, BUCKET, KWARGS, trainer_stall), daemon=True
        )
        self.rollout = ctx.Process(
            target=peers.rollout_main, args=(rollout_end, steps, BUCKET, KWARGS, rollout_stall), daemon=True
        )
        self.trainer.start()
        self.rollout.start()

    def topology(self, wait_s: float = START_S) -> tuple[dict, dict]:
        """Each side's prepare() through build_topology() into its init_process_group(), as verl's manager does."""
        trainer_meta = self.expect(self.trainer_pipe, "meta", wait_s)
        rollout_meta = self.expect(self.rollout_pipe, "meta", wait_s)
        actor_kwargs, rollout_kwargs = self.backend.build_topology(1, 1, [trainer_meta, rollout_meta])
        self.trainer_pipe.send({key: values[0] for key, values in actor_kwargs.items()})
        self.rollout_pipe.send({key: values[0] for key, values in rollout_kwargs.items()})
        return trainer_meta, rollout_meta

    @staticmethod
    def expect(pipe: Any, kind: str, wait_s: float) -> Any:
        assert pipe.poll(wait_s), f"no {kind!r} from the peer within {wait_s} s"
        got, payload = pipe.recv()
        assert got == kind, f"expected {kind!r}, the peer said {got!r}: {payload}"
        return payload

    def close(self) -> None:
        for proc in (self.trainer, self.rollout):
            proc.join(10.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)


@pytest.fixture
def pairs(registry):
    made: list[Pair] = []

    def make(steps: int, **stalls: int) -> Pair:
        made.append(Pair(registry, steps, **stalls))
        return made[-1]

    yield make
    for pair in made:
        pair.close()


# -- selected by configuration through verl's registry --------------------------------------------------------------


def test_verl_builds_the_backend_from_its_own_config(registry):
    """The keys a user sets, read by verl's CheckpointEngineConfig, build our engine the way verl's trainer worker
    does (verl/workers/engine_workers.py, ActorRolloutRefWorker.init_model)."""
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import import_external_libs

    from refitkit.integrations.verl import RefitkitCheckpointEngine

    section = OmegaConf.create(
        {
            "_target_": "verl.workers.config.CheckpointEngineConfig",
            "backend": "refitkit",
            "update_weights_bucket_megabytes": 64,
            "custom_backend_module": "refitkit.integrations.verl",
            "engine_kwargs": {"refitkit": {"timeout_s": 7, "transport": "shm"}},
        }
    )
    config = omega_conf_to_dataclass(section)
    import_external_libs(config.custom_backend_module or None)
    engine = registry.new(
        config.backend,
        is_master=True,
        bucket_size=config.update_weights_bucket_megabytes << 20,
        **config.engine_kwargs.get(config.backend, {}),
    )
    assert type(engine) is RefitkitCheckpointEngine
    assert (engine.bucket_size, engine.timeout_s, engine.transport, engine.is_master) == (64 << 20, 7, "shm", True)
    assert engine.prepare() == {"host": socket.gethostname(), "endpoint": engine.info.endpoint}


def test_the_backend_has_every_call_of_verls_checkpoint_engine(registry):
    from verl.checkpoint_engine import CheckpointEngine

    ours = registry.get(peers.BACKEND)
    assert CheckpointEngine.__abstractmethods__ == {
        "prepare",
        "build_topology",
        "init_process_group",
        "finalize",
        "send_weights",
        "receive_weights",
    }
    for name in CheckpointEngine.__abstractmethods__ - {"receive_weights"}:
        theirs, mine = getattr(CheckpointEngine, name), getattr(ours, name)
        assert inspect.iscoroutinefunction(theirs) == inspect.iscoroutinefunction(mine), name
        assert set(inspect.signature(theirs).parameters) - {"kwargs"} <= set(inspect.signature(mine).parameters), name
    # Declared `async def` there, but verl's CheckpointEngineWorker calls it without awaiting and hands the result to
    # its rollout adapter's `async for`, as its own engines (nccl, nixl) do: an async generator.
    assert inspect.isasyncgenfunction(ours.receive_weights)
    assert set(inspect.signature(ours.receive_weights).parameters) == {"self", "global_steps"}
    assert ours.wire_format == CheckpointEngine.wire_format == "named_tensors"


# -- the sync, two processes ----------------------------------------------------------------------------------------


def test_two_steps_arrive_bit_exact_over_one_kept_channel(pairs):
    pair = pairs(steps=2)
    channels = set()
    for step in range(2):
        trainer_meta, rollout_meta = pair.topology()
        sent = pair.expect(pair.trainer_pipe, "sent", START_S)
        received = pair.expect(pair.rollout_pipe, "received", START_S)
        arrived = [peers.from_record(record) for record in received["weights"]]
        expected = peers.model_weights(step)
        assert [name for name, _ in arrived] == [name for name, _ in expected]
        for (name, got), (_, want) in zip(arrived, expected):
            assert bits_equal(got, want), f"step {step}: {name} differs"
        nbytes = sum(tensor.nbytes for _, tensor in expected)
        assert sent["metrics"]["refitkit/sync_bytes"] == nbytes
        assert sent["metrics"]["refitkit/sync_s"] > 0
        channels.add((sent["channel"], received["channel"], trainer_meta["endpoint"]))
    assert len(channels) == 1, f"each step re-made the channel: {channels}"


def test_a_rollout_rank_killed_mid_sync_fails_the_trainers_step_at_once(pairs):
    pair = pairs(steps=1, rollout_stall=2)
    pair.topology()
    pair.expect(pair.rollout_pipe, "stalled", START_S)  # two tensors taken, the sync is on
    os.kill(pair.rollout.pid, signal.SIGKILL)
    killed = time.monotonic()
    error = pair.expect(pair.trainer_pipe, "error", TIMEOUT_S)
    noticed_s = time.monotonic() - killed
    assert noticed_s < NOTICED_S, f"the trainer noticed the killed rollout rank after {noticed_s:.1f} s"
    assert error["type"] == "PeerGone" and "RefitError" in error["mro"], error
    assert "is gone (its connection closed: it died or closed its socket)" in error["message"], error
    assert any(
        "verl checkpoint engine 'refitkit', send_weights() at global step 0 on the trainer side" in note
        and "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.refitkit.timeout_s=60" in note
        for note in error["notes"]
    ), error


def test_a_trainer_rank_killed_mid_sync_fails_the_rollout_side_at_once(pairs):
    pair = pairs(steps=1, trainer_stall=3)
    pair.topology()
    pair.expect(pair.trainer_pipe, "stalled", START_S)  # three tensors out of the generator, the fourth never comes
    os.kill(pair.trainer.pid, signal.SIGKILL)
    killed = time.monotonic()
    error = pair.expect(pair.rollout_pipe, "error", TIMEOUT_S)
    noticed_s = time.monotonic() - killed
    assert noticed_s < NOTICED_S, f"the rollout side noticed the killed trainer rank after {noticed_s:.1f} s"
    assert error["type"] == "PeerGone" and "RefitError" in error["mro"], error
    assert "is gone (its connection closed: it died or closed its socket)" in error["message"], error
    assert any(
        "receive_weights() at global step 0 on the rollout side" in note and "max_sync_s" in note
        for note in error["notes"]
    ), error


# -- topology and roles, in this process ------------------------------------------------------------------------


def _meta(host: str, endpoint: str) -> dict[str, str]:
    return {"host": host, "endpoint": endpoint}


def test_build_topology_pairs_rollout_rank_j_with_trainer_rank_j(registry):
    backend = registry.get(peers.BACKEND)
    metadata = [_meta("a", "t0"), _meta("a", "t1"), _meta("a", "t2"), _meta("a", "r0"), _meta("a", "r1")]
    actor, rollout = backend.build_topology(3, 2, metadata)
    assert actor == {"role": ["trainer"] * 3, "endpoint": ["t0", "t1", None]}
    assert rollout == {"role": ["rollout"] * 2, "endpoint": ["t0", "t1"]}


@pytest.mark.parametrize(
    ("actors", "rollouts", "metadata", "message"),
    [
        pytest.param(
            1,
            2,
            [_meta("a", "t0"), _meta("a", "r0"), _meta("a", "r1")],
            "2 rollout ranks but 1 trainer ranks; use a rollout world no larger than the trainer's, or "
            "checkpoint_engine.backend=nccl across hosts",
            id="more-rollout-ranks",
        ),
        pytest.param(
            1,
            1,
            [_meta("a", "t0"), _meta("b", "r0")],
            "rollout rank 0 is on host 'b' but its trainer rank 0 on 'a'",
            id="other-host",
        ),
        pytest.param(1, 1, [_meta("a", "t0")], "got 1 metadata entries for 1 trainer and 1 rollout ranks", id="short"),
        pytest.param(1, 1, [_meta("a", "t0"), {"host": "a"}], "metadata[1] is {'host': 'a'}", id="no-endpoint"),
    ],
)
def test_build_topology_refuses_what_its_channel_cannot_join(registry, actors, rollouts, metadata, message):
    with pytest.raises(InvalidInput) as raised:
        registry.get(peers.BACKEND).build_topology(actors, rollouts, metadata)
    assert message in str(raised.value)


def test_an_unpaired_trainer_rank_walks_its_weights_and_sends_nothing(registry):
    """Its engine's get_per_tensor_param() gathers collectively: every trainer rank must walk it to the end."""
    engine = registry.new(peers.BACKEND, is_master=False, bucket_size=BUCKET, **KWARGS)
    engine.init_process_group(role="trainer", endpoint=None)
    walked = []

    def weights():
        for name, tensor in peers.model_weights(0):
            walked.append(name)
            yield name, tensor

    assert asyncio.run(engine.send_weights(weights())) == {}
    assert walked == [name for name, _ in peers.model_weights(0)]
    assert engine.channel is None
    engine.close()


def test_calls_out_of_order_are_refused_with_the_step_verl_missed(registry):
    engine = registry.new(peers.BACKEND, bucket_size=BUCKET, **KWARGS)
    with pytest.raises(RefitError) as raised:
        asyncio.run(engine.send_weights(iter([("w", torch.zeros(2))])))
    assert str(raised.value) == (
        "refitkit checkpoint engine: send_weights() on a rank whose role is 'unset' (needs 'trainer'); verl calls "
        "init_process_group() with build_topology()'s keywords first"
    )
    with pytest.raises(InvalidInput, match=r"role='actor'; build_topology\(\) gives 'trainer' or 'rollout'"):
        engine.init_process_group(role="actor", endpoint="t0")


# -- the bounded barrier across trainer ranks ---------------------------------------------------------------------


def test_the_barrier_lines_up_trainer_ranks_and_a_missing_rank_fails_the_others_within_its_bound():
    from tests.helpers.world import run_world

    results = run_world(peers.barrier_rank, 2, 1, timeout_s=START_S)
    assert results[1] == {"absent": True}
    error, elapsed_s = results[0]["error"], results[0]["elapsed_s"]
    assert error["type"] == "BarrierTimeout" and "RefitError" in error["mro"], error
    assert "barrier after trainer offload" in error["message"] and "on rank 0" in error["message"], error
    assert error["notes"] == [
        "verl checkpoint engine 'refitkit', barrier() after trainer offload: bound "
        "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.refitkit.barrier_timeout_s=3"
    ]
    bound_s = peers.BARRIER_TIMEOUT_S
    assert bound_s - 0.5 <= elapsed_s < bound_s + NOTICED_S, f"gave up after {elapsed_s:.1f} s (bound {bound_s} s)"


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        pytest.param({"timeout_s": -1}, "timeout_s=-1; need a finite number of seconds above 0", id="timeout_s"),
        pytest.param({"transport": "tcp"}, "transport='tcp'; expected one of", id="transport"),
        pytest.param({"direct": "yes"}, "engine_kwargs.refitkit.direct='yes': need true or false", id="direct"),
        pytest.param(
            {"barrier_timeout_s": "5"},
            "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.refitkit.barrier_timeout_s='5' is a str",
            id="barrier_timeout_s",
        ),
        pytest.param(
            {"device": "gpu0"},
            "engine_kwargs.refitkit.device='gpu0': need 'auto' or a torch device name",
            id="device",
        ),
    ],
)
def test_bad_engine_kwargs_fail_when_verl_builds_the_engine(registry, knobs, message):
    with pytest.raises(InvalidInput) as raised:
        registry.new(peers.BACKEND, is_master=True, bucket_size=BUCKET, **knobs)
    assert message in str(raised.value)


def test_the_rollout_side_waits_off_the_event_loop(registry):
    """verl awaits receive_weights() on a Ray actor's event loop: while it waits for a slow trainer rank, that loop
    keeps serving (here a ticker; in verl the actor's other calls)."""
    import threading

    trainer = registry.new(peers.BACKEND, is_master=True, bucket_size=BUCKET, **KWARGS)
    rollout = registry.new(peers.BACKEND, bucket_size=BUCKET, **KWARGS)
    actor, rollout_kwargs = registry.get(peers.BACKEND).build_topology(1, 1, [trainer.prepare(), rollout.prepare()])
    trainer.init_process_group(**{key: values[0] for key, values in actor.items()})
    rollout.init_process_group(**{key: values[0] for key, values in rollout_kwargs.items()})
    delay_s, outcome = 1.0, {}

    def send_late() -> None:
        time.sleep(delay_s)
        outcome["metrics"] = asyncio.run(trainer.send_weights(peers.model_weights(0)))

    async def consume_and_tick() -> tuple[list, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        ticker = asyncio.create_task(tick())
        received = [peers.as_record(name, tensor) async for name, tensor in rollout.receive_weights(global_steps=0)]
        ticker.cancel()
        return received, ticks

    sender = threading.Thread(target=send_late)
    sender.start()
    try:
        received, ticks = asyncio.run(consume_and_tick())
    finally:
        sender.join(TIMEOUT_S)
        trainer.close()
        rollout.close()
    assert ticks >= 10, f"the event loop ran {ticks} times in the {delay_s} s the receiver waited"
    arrived = [peers.from_record(record) for record in received]
    assert all(bits_equal(got, want) for (_, got), (_, want) in zip(arrived, peers.model_weights(0)))
    assert len(arrived) == len(peers.model_weights(0)) and outcome["metrics"]["refitkit/sync_bytes"] > 0
