"""refitkit in verl 0.9.1's colocated loop: the configuration a user writes selects refitkit's manager, backend and
training engine; the manager runs verl's update_weights sequence over verl's own Ray worker group, each phase timed.

The config is composed from verl's own ``ppo_trainer`` YAML with hydra, as ``verl.trainer.main_ppo`` composes it, and
read the way verl's trainer, workers and ``run_ppo`` read it. The manager test runs real Ray: two trainer ranks in
verl's ``RayWorkerGroup`` (gloo), each with verl's own ``ActorRolloutRefWorker.update_weights`` /
``execute_checkpoint_engine`` and refitkit's checkpoint engine built by verl's registry, and two rollout servers that
receive through refitkit's channel (see ``colocated_peers`` for what stands in for vLLM and verl's FSDP engine).

Needs a GPU, not run here: ``RefitkitFSDPEngine`` itself. verl 0.9.1 on a machine without an accelerator falls back to
the ``nvidia`` platform (``get_device_name() == "cuda"``), so ``FSDPEngine.__init__`` builds its device mesh on
``cuda`` and torch's CPU build fails in ``torch.cuda.set_device`` (``_init_device_mesh`` ->
``create_device_mesh`` -> ``init_device_mesh("cuda", ...)``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from refitkit.errors import InvalidInput, TransferError

pytestmark = pytest.mark.timeout(240)

MODULE = "refitkit.integrations.verl"
MANAGER = f"{MODULE}.RefitkitCheckpointManager"
USER_OVERRIDES = [  # what a verl user adds to the command line of verl.trainer.main_ppo
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=refitkit",
    f"actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module={MODULE}",
    "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.refitkit.timeout_s=30",
    "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.refitkit.barrier_timeout_s=20",
    f"+actor_rollout_ref.rollout.checkpoint_manager_class={MANAGER}",
    f"actor_rollout_ref.model.external_lib={MODULE}",
    "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_ENGINE_VENDOR=refitkit",
    "+actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls="
    "refitkit.integrations.verl.vllm.VerlRefitWorkerExtension",
    "trainer.use_v1=false",  # verl 0.9.1's v1 trainer builds its own naive manager whatever the config says
]


def compose(overrides: list[str]) -> Any:
    """verl's ``ppo_trainer`` config with ``overrides``, composed by hydra as ``main_ppo``'s ``@hydra.main`` does."""
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=overrides)


def test_configuration_alone_selects_refitkit(monkeypatch: pytest.MonkeyPatch) -> None:
    from omegaconf import OmegaConf
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import import_external_libs, load_class_from_fqn
    from verl.workers.engine.base import EngineRegistry

    from refitkit.integrations.verl import RefitkitCheckpointEngine
    from refitkit.integrations.verl.colocated import (
        RefitkitCheckpointManager,
        RefitkitFSDPEngine,
        RefitkitMegatronEngine,
    )

    config = compose(USER_OVERRIDES)
    rollout = config.actor_rollout_ref.rollout
    # the driver (ray_trainer.py): the manager class by its fully qualified name
    assert load_class_from_fqn(rollout.get("checkpoint_manager_class"), "CheckpointEngineManager") is (
        RefitkitCheckpointManager
    )
    # the trainer ranks (engine_workers.py, init_model): the backend by name, with our knobs
    engine_config = omega_conf_to_dataclass(rollout.checkpoint_engine)
    import_external_libs(engine_config.custom_backend_module)
    engine = CheckpointEngineRegistry.new(
        engine_config.backend,
        is_master=True,
        bucket_size=engine_config.update_weights_bucket_megabytes << 20,
        **engine_config.engine_kwargs.get(engine_config.backend, {}),
    )
    assert type(engine) is RefitkitCheckpointEngine
    assert (engine.timeout_s, engine.barrier_timeout_s, engine.bucket_size) == (30.0, 20.0, 2048 << 20)
    # every worker's environment (main_ppo.run_ppo merges ray_kwargs.ray_init.runtime_env into Ray's)
    runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(config), config.ray_kwargs.ray_init.runtime_env)
    assert runtime_env.env_vars.VERL_ENGINE_VENDOR == "refitkit"
    # the training engine: model.external_lib is imported when the model config is built, then the registry picks
    import_external_libs(config.actor_rollout_ref.model.external_lib)
    monkeypatch.setenv("VERL_ENGINE_VENDOR", runtime_env.env_vars.VERL_ENGINE_VENDOR)
    strategy = config.actor_rollout_ref.actor.strategy
    assert EngineRegistry.get_engine_cls("language_model", strategy) is RefitkitFSDPEngine
    assert EngineRegistry.get_engine_cls("language_model", "fsdp") is RefitkitFSDPEngine  # refused when built
    # strategy=megatron: the Megatron engine (megatron-core in this venv; test_megatron_engine.py moves a real GPT)
    assert RefitkitMegatronEngine is not None
    assert EngineRegistry.get_engine_cls("language_model", "megatron") is RefitkitMegatronEngine
    # the critic's value-model engine is not ours: verl's own is kept
    assert EngineRegistry.get_engine_cls("value_model", strategy) is not RefitkitFSDPEngine
    monkeypatch.delenv("VERL_ENGINE_VENDOR")
    assert EngineRegistry.get_engine_cls("language_model", strategy) is not RefitkitFSDPEngine  # off without it


def test_a_bad_knob_fails_when_the_manager_is_built() -> None:
    from verl.utils.config import omega_conf_to_dataclass

    from refitkit.integrations.verl.colocated import RefitkitCheckpointManager

    config = compose(
        [*USER_OVERRIDES, "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.refitkit.phase_timeout_s=-1"]
    )
    engine_config = omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine)
    with pytest.raises(InvalidInput, match=r"engine_kwargs\.refitkit\.phase_timeout_s"):
        RefitkitCheckpointManager(engine_config, actor_wg=None, replicas=[])
    naive = omega_conf_to_dataclass(compose([]).actor_rollout_ref.rollout.checkpoint_engine)
    with pytest.raises(InvalidInput, match=r"checkpoint_engine\.backend=refitkit \(got 'naive'\)"):
        RefitkitCheckpointManager(naive, actor_wg=None, replicas=[])


def test_a_vllm_rollout_without_refitkits_worker_extension_fails_when_the_manager_is_built() -> None:
    from verl.utils.config import omega_conf_to_dataclass

    from refitkit.integrations.verl.colocated import RefitkitCheckpointManager

    without = compose([o for o in USER_OVERRIDES if "worker_extension_cls" not in o])
    engine_config = omega_conf_to_dataclass(without.actor_rollout_ref.rollout.checkpoint_engine)
    replica = Replica(omega_conf_to_dataclass(without.actor_rollout_ref.rollout), server=None)
    with pytest.raises(InvalidInput) as refused:
        RefitkitCheckpointManager(engine_config, actor_wg=None, replicas=[replica])
    assert str(refused.value) == (
        "actor_rollout_ref.rollout.checkpoint_manager_class: replica 0's vLLM workers would run verl's own extension, "
        "which has no 'refit_receive'; set +actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls="
        "refitkit.integrations.verl.vllm.VerlRefitWorkerExtension (verl's extension and refitkit's in one)"
    )
    # with the key (USER_OVERRIDES), the same replica is accepted
    config = compose(USER_OVERRIDES)
    replica = Replica(omega_conf_to_dataclass(config.actor_rollout_ref.rollout), server=None)
    manager = RefitkitCheckpointManager(engine_config, actor_wg=None, replicas=[replica])
    assert manager.replicas == [replica]


# -- the manager over real Ray ---------------------------------------------------------------------------------


class Replica:
    """verl's rollout replica as the manager uses it: its rollout config, world size and server handles."""

    def __init__(self, config: Any, server: Any) -> None:
        self.config, self.servers, self.world_size = config, [server], 1

    async def sleep(self) -> None:
        import ray

        ray.get([server.sleep.remote() for server in self.servers], timeout=30)


@pytest.fixture(scope="module")
def ray_session() -> Any:
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(num_cpus=32, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def actors(ray_session: Any) -> Any:
    """What a test started in Ray (worker groups, servers), killed after it so the next test has the CPUs."""
    started: list[Any] = []
    yield started
    for handle in started:
        ray_session.kill(handle)


def build(
    ray: Any, actors: list[Any], engine_kwargs: dict[str, Any], stall_after: int | None = None
) -> tuple[Any, Any, list[Any]]:
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.utils.config import omega_conf_to_dataclass

    from refitkit.integrations.verl.colocated import RefitkitCheckpointManager
    from tests.engines.verl import colocated_peers as peers

    overrides = [
        f"+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.refitkit.{k}={v}" for k, v in engine_kwargs.items()
    ]
    config = compose([o for o in USER_OVERRIDES if "checkpoint_engine.engine_kwargs" not in o] + overrides)
    pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1)
    actor_wg = RayWorkerGroup(
        resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(peers.TrainerRank))
    )
    actors.extend(actor_wg.workers)
    assert actor_wg.init_model(dict(engine_kwargs)) == [0, 1]
    rollout_config = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    server_cls = peers.rollout_server_class()
    servers = [server_cls.remote(stall_after=stall_after if i == 0 else None, stall_s=8.0) for i in range(2)]
    actors.extend(servers)
    replicas = [Replica(rollout_config, server) for server in servers]
    engine_config = omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine)
    return RefitkitCheckpointManager(engine_config, actor_wg, replicas), actor_wg, servers


def test_manager_runs_the_colocated_sequence_each_phase_timed(
    ray_session: Any, actors: list[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from refitkit.integrations.verl.colocated import METRIC, METRICS_FILE_ENV, PHASES

    ray = ray_session
    metrics_file = tmp_path / "refitkit-metrics.jsonl"
    monkeypatch.setenv(METRICS_FILE_ENV, str(metrics_file))
    written = []
    manager, actor_wg, servers = build(ray, actors, {"timeout_s": 30, "barrier_timeout_s": 20, "transport": "shm"})
    for step in (1, 2):
        expected = actor_wg.train_step(step)[0]
        start = time.time()
        metrics = manager.update_weights(step)  # as ray_trainer calls it: no await
        states = ray.get([server.state.remote() for server in servers], timeout=30)
        # every replica got the trainer's weights, bit for bit (trainer rank j -> replica j)
        assert [state["received"] for state in states] == [expected, expected]
        # the order of verl's naive path: weights woken, sync, ..., KV cache woken last, once per step per server
        for state in states:
            calls = [(what, arg) for what, arg, at in state["log"] if at >= start]
            assert calls == [
                ("wake_up", ["weights"]),
                ("receive", calls[1][1]),
                ("received", 3),
                ("wake_up", ["kv_cache"]),
            ]
        # the trainer's offload went through refitkit's adapter on every rank
        assert [s["model"] for s in actor_wg.model_state()] == ["OFFLOADED", "OFFLOADED"]
        for phase in PHASES:
            assert metrics[f"{METRIC}/{phase}_s"] > 0
        assert metrics[f"{METRIC}/total_s"] >= sum(metrics[f"{METRIC}/{phase}_s"] for phase in PHASES)
        assert metrics[f"{METRIC}/sync_sync_bytes_sum"] == 2 * (64 * 48 * 2 + 300 * 200 * 4 + 48 * 2)
        assert metrics[f"{METRIC}/trainer_host_rss_bytes_max"] > 0
        assert manager.last_metrics == metrics
        written.append({"step": step, "metrics": metrics})
        # each step's metrics appended to the file the benchmark reads (verl's trainer drops the return value)
        assert [json.loads(line) for line in metrics_file.read_text().splitlines()] == written
    # the trainer ranks' channels were kept: one receive endpoint per replica for both steps
    endpoints = {arg for state in states for what, arg, _ in state["log"] if what == "receive"}
    assert len(endpoints) == 2


def test_a_stalled_rollout_fails_the_step_with_refitkits_error_then_the_next_syncs(
    ray_session: Any, actors: list[Any]
) -> None:
    ray = ray_session
    manager, actor_wg, servers = build(
        ray, actors, {"timeout_s": 2, "max_sync_s": 30, "transport": "shm"}, stall_after=1
    )
    actor_wg.train_step(3)
    with pytest.raises(TransferError, match=r"within timeout_s=2 \(peer dead or stuck") as failed:
        manager.update_weights(3)
    failed_at = time.time()
    receive_at = next(at for what, _, at in ray.get(servers[0].state.remote(), timeout=30)["log"] if what == "receive")
    # from the stalled server's receive to the step's failure: the bound of one wait (2 s), not the stall (8 s)
    assert failed_at - receive_at < 2 + 4, f"the stalled sync failed {failed_at - receive_at:.1f} s after its receive"
    notes = "\n".join(getattr(failed.value, "__notes__", []))
    assert (
        "actor_rollout_ref.rollout.checkpoint_manager_class (refitkit), update_weights phase 'sync' at global step 3"
        in notes
    )
    assert "engine_kwargs.refitkit.timeout_s=2" in notes
    # the stalled server's receive ends (it had every byte: the sender gave up on its release), then the next attempt
    # syncs cleanly
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        log = ray.get(servers[0].state.remote(), timeout=30)["log"]
        if any(what in ("received", "receive_failed") for what, _, _ in log):
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the stalled server never ended its receive: {log}")
    expected = actor_wg.train_step(4)[0]
    manager.update_weights(4)
    assert [ray.get(s.state.remote(), timeout=30)["received"] for s in servers] == [expected, expected]
