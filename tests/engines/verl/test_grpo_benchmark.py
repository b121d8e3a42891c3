"""benchmarks/verl_grpo.py against verl 0.9.1 on CPU, short of training: its hydra overrides compose with verl's own
``ppo_trainer`` config and pass what ``main_ppo`` checks before it starts Ray (``validate_config``, the dataclass
conversions its workers make); the tokenizer, prompts and reward file it writes load through verl's own readers; its
checkpoint's names and shapes are transformers' ``Qwen3ForCausalLM``'s (2 layers of the real widths here; the GPU
run writes 28)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import verl_boundaries, verl_grpo
from tests.engines.verl.test_colocated import compose

pytestmark = pytest.mark.timeout(240)


def args(**changes: Any) -> argparse.Namespace:
    values = dict(
        steps=4,
        batch=4,
        n=4,
        response_length=32,
        gpu_memory_utilization=0.3,
        timeout_s=60.0,
        transport="auto",
        ray_cpus=0,
        kill_sync=2,
    )
    return argparse.Namespace(**{**values, **changes})


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """What the benchmark writes before its runs: a 2-layer checkpoint of the real widths, 8 prompts, the reward."""
    work = tmp_path_factory.mktemp("verl-grpo")
    model = verl_grpo.write_checkpoint(work / "model", layers=2)
    return model, verl_grpo.write_prompts(work / "prompts.parquet", count=8), verl_grpo.write_reward(work / "reward.py")


@pytest.mark.parametrize("mode", verl_grpo.MODES)
def test_overrides_compose_and_pass_verls_checks(mode: str, tmp_path: Path, inputs: tuple[Path, Path, Path]) -> None:
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.utils.import_utils import load_class_from_fqn

    model, prompts, reward = map(str, inputs)
    config = compose(verl_grpo.overrides(mode, model, prompts, reward, str(tmp_path), args()))
    OmegaConf.resolve(config)  # every interpolation resolves
    # what main_ppo.main checks before run_ppo: no critic, no reference model for this GRPO run
    assert not need_critic(config)
    assert not need_reference_policy(config)
    validate_config(config=config, use_reference_policy=False, use_critic=False)
    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    assert (rollout.name, rollout.n, rollout.free_cache_engine, rollout.response_length) == ("vllm", 4, True, 32)
    assert rollout.gpu_memory_utilization == 0.3
    omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    hf_model = omega_conf_to_dataclass(config.actor_rollout_ref.model)  # loads the checkpoint's config, tokenizer
    assert hf_model.hf_config._attn_implementation == "sdpa" and hf_model.tokenizer.eos_token == "<|im_end|>"
    engine = omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine)
    assert config.algorithm.adv_estimator == "grpo"
    assert config.trainer.use_v1 is False and list(config.trainer.logger) == ["console", "file"]
    assert config.ray_kwargs.ray_init.num_cpus is None  # Ray takes every CPU: too few and its actors wait silently
    env_vars = config.ray_kwargs.ray_init.runtime_env.env_vars
    assert env_vars.VERL_FILE_LOGGER_PATH == f"{tmp_path}/{mode}.verl.jsonl"
    manager_fqn = config.actor_rollout_ref.rollout.get("checkpoint_manager_class")
    if mode == "naive":  # verl's own path, untouched; only its boundary lines are recorded (verl_boundaries)
        assert engine.backend == "naive" and manager_fqn is None
        assert config.actor_rollout_ref.model.external_lib == verl_grpo.BOUNDARIES_MODULE
        assert env_vars[verl_grpo.BOUNDARIES_ENV] == f"{tmp_path}/naive.boundaries.jsonl"
        assert "worker_extension_cls" not in (rollout.engine_kwargs.get("vllm") or {})
        return
    from refitkit.integrations.verl.colocated import METRICS_FILE_ENV, VLLM_EXTENSION, RefitkitCheckpointManager

    assert engine.backend == "refitkit"
    assert dict(engine.engine_kwargs["refitkit"]) == {"timeout_s": 60.0, "barrier_timeout_s": 60.0, "transport": "auto"}
    assert load_class_from_fqn(manager_fqn, "CheckpointEngineManager") is RefitkitCheckpointManager
    assert env_vars.VERL_ENGINE_VENDOR == "refitkit"
    assert env_vars[METRICS_FILE_ENV] == f"{tmp_path}/{mode}.refitkit.jsonl"
    extension = rollout.engine_kwargs["vllm"]["worker_extension_cls"]
    if mode == "refitkit":
        assert extension == VLLM_EXTENSION and verl_grpo.KILL_SYNC_ENV not in env_vars
        return
    assert extension == verl_grpo.PLANTED_EXTENSION  # refitkit's extension with the planted kill (test below)
    assert env_vars[verl_grpo.KILL_SYNC_ENV] == 2
    assert env_vars[verl_grpo.PLANT_FILE_ENV] == f"{tmp_path}/killed.killed-at"


def test_a_bad_mode_is_refused() -> None:
    with pytest.raises(ValueError, match=r"mode must be one of \('naive', 'refitkit', 'killed'\), got 'fast'"):
        verl_grpo.overrides("fast", "/m", "/p", "/r", "/o", args())


def test_inputs_load_through_verls_readers(tmp_path: Path, inputs: tuple[Path, Path, Path]) -> None:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, Qwen3ForCausalLM
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.utils import hf_tokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    model, prompts, reward = inputs
    config = compose(verl_grpo.overrides("refitkit", str(model), str(prompts), str(reward), str(tmp_path), args()))

    tokenizer = hf_tokenizer(str(model))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "what is 3 plus 4 ?"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nwhat is 3 plus 4 ?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id not in ids
    hf = AutoConfig.from_pretrained(str(model))
    assert (hf.model_type, hf.head_dim, hf.num_attention_heads, hf.num_key_value_heads) == ("qwen3", 128, 16, 8)
    assert hf.vocab_size >= len(tokenizer) and hf.vocab_size % 64 == 0 and hf.tie_word_embeddings
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Qwen3ForCausalLM(hf).state_dict().items() if k != "lm_head.weight"}
    weights = load_file(str(model / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}
    assert torch.equal(weights["model.norm.weight"], torch.ones(1024, dtype=torch.bfloat16))

    dataset = RLHFDataset(data_files=[str(prompts)], tokenizer=tokenizer, config=config.data)
    assert len(dataset) == 8
    row = dataset[0]
    assert row["data_source"] == "refitkit/synthetic-sum"
    assert row["raw_prompt"][0]["role"] == "user" and row["raw_prompt"][0]["content"].startswith("what is ")
    assert json.loads(json.dumps(row["reward_model"]))["ground_truth"].isdigit()

    score = get_custom_reward_fn(config)
    assert score("refitkit/synthetic-sum", "the answer is 7", "7") == 1.0
    assert score("refitkit/synthetic-sum", "one 2 three 4", "9") == 0.5


def test_the_table_puts_both_modes_side_by_side(tmp_path: Path) -> None:
    for mode, update_s in (("naive", 2.0), ("refitkit", 1.5)):
        record = {"step": 1, "data": {"timing_s/update_weights": update_s, "actor/lr": 1e-5}}
        (tmp_path / f"{mode}.verl.jsonl").write_text(json.dumps(record) + "\n")
    (tmp_path / "refitkit.refitkit.jsonl").write_text(
        json.dumps({"step": 1, "metrics": {"refitkit/update_weights/sync_s": 0.4}}) + "\n"
    )
    results = {
        mode: {"returncode": 0, "wall_s": 10.0, "steps": verl_grpo.collect(tmp_path, mode)}
        for mode in ("naive", "refitkit")
    }
    assert results["naive"]["steps"] == [{"step": 1, "verl": {"timing_s/update_weights": 2.0}}]
    assert results["refitkit"]["steps"][0]["refitkit"] == {"refitkit/update_weights/sync_s": 0.4}
    text = verl_grpo.table(results)
    assert "| timing_s/update_weights (naive) | timing_s/update_weights (refitkit) |" in text
    assert text.splitlines()[2].startswith("| 1 | 2 | 1.5 |")
    assert "| 1 | 0.4 |" in text


def test_the_killed_modes_outcome_names_refitkits_error_and_the_time_to_the_end(tmp_path: Path) -> None:
    note, log = tmp_path / "killed.killed-at", tmp_path / "killed.log"
    note.write_text("1000.0\n")
    log.write_text(
        "step:1 - timing_s/update_weights:1.2\n"
        "ray.exceptions.RayTaskError(PeerGone): the receiver on 'verl-refit-0' (pid 77) is gone: no done for bucket 3\n"
        "Error executing job with overrides: [...]\n"
    )
    outcome = verl_grpo.planted_outcome(note, log, ended=1004.5)
    assert outcome == {
        "killed_at": 1000.0,
        "ended_after_kill_s": 4.5,
        "refitkit_error": "ray.exceptions.RayTaskError(PeerGone): the receiver on 'verl-refit-0' (pid 77) is gone: "
        "no done for bucket 3",
    }
    log.write_text("ray.exceptions.ActorDiedError: the actor died unexpectedly\n")  # a hang's or a crash's way out
    note.unlink()
    assert verl_grpo.planted_outcome(note, log, ended=5.0) == {
        "killed_at": None,
        "ended_after_kill_s": None,
        "refitkit_error": None,
    }
    assert "PeerGone" in verl_grpo.refitkit_error_names() and "RefitError" in verl_grpo.refitkit_error_names()


def test_the_plant_reads_which_sync_to_kill_and_refuses_nonsense() -> None:
    assert verl_grpo.kill_plan({}) == (0, 0.002, None)
    assert verl_grpo.kill_plan({verl_grpo.KILL_SYNC_ENV: "2", verl_grpo.PLANT_FILE_ENV: "/n"}) == (2, 0.002, "/n")
    with pytest.raises(ValueError, match="REFITKIT_PLANT_KILL_SYNC=-1 must be >= 0"):
        verl_grpo.kill_plan({verl_grpo.KILL_SYNC_ENV: "-1"})


def test_the_planted_extension_is_refitkits_for_verl_with_every_rpc() -> None:
    pytest.importorskip("vllm", reason="vLLM's worker classes (the GPU machine's kit)")
    from verl.utils.import_utils import load_class_from_fqn

    from refitkit.integrations.verl.colocated import VLLM_EXTENSION

    planted = load_class_from_fqn(verl_grpo.PLANTED_EXTENSION, "extension")
    assert issubclass(planted, load_class_from_fqn(VLLM_EXTENSION, "extension"))
    assert planted.refit_receive is not load_class_from_fqn(VLLM_EXTENSION, "extension").refit_receive


# -- verl's own path, phase by phase (benchmarks/verl_boundaries.py) -------------------------------------------


def test_the_boundaries_are_the_lines_verls_update_weights_logs_in_that_order() -> None:
    import inspect

    from verl.workers.engine_workers import ActorRolloutRefWorker

    source = inspect.getsource(ActorRolloutRefWorker.update_weights)
    places = [source.find(f'log_gpu_memory_usage("{head}"') for head in verl_boundaries.HEADS]
    assert -1 not in places and places == sorted(places), dict(zip(verl_boundaries.HEADS, places))


def test_verls_boundary_lines_are_recorded_with_memory_and_become_one_calls_phases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import logging

    from verl.utils.profiler import performance
    from verl.workers import engine_workers

    # the CUDA query behind verl's line: the CPU has none (the line's text and the logger are verl's own)
    monkeypatch.setattr(performance, "_get_current_mem_info", lambda: ("1.00", "2.00", "3.00", "80.00"))
    path = tmp_path / "naive.boundaries.jsonl"
    level = engine_workers.logger.level  # restored after the test (setLevel: logging caches the levels)
    handler = verl_boundaries.install({verl_boundaries.FILE_ENV: str(path)})
    try:
        assert handler is verl_boundaries.install({verl_boundaries.FILE_ENV: str(path)})  # once per logger
        assert engine_workers.logger.level == logging.DEBUG
        for head in verl_boundaries.HEADS[:3]:
            performance.log_gpu_memory_usage(head, logger=engine_workers.logger)
        performance.log_gpu_memory_usage("Before something else", logger=engine_workers.logger)  # not a boundary
        for head in verl_boundaries.HEADS[3:]:
            performance.log_gpu_memory_usage(head, logger=engine_workers.logger)
        performance.log_gpu_memory_usage(verl_boundaries.HEADS[0], logger=engine_workers.logger)  # cut short
    finally:
        engine_workers.logger.removeHandler(handler)
        engine_workers.logger.setLevel(level)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["head"] for line in lines] == [*verl_boundaries.HEADS, verl_boundaries.HEADS[0]]
    assert all(line["host_rss_bytes"] > 1 << 20 and "device_free_bytes" not in line for line in lines)
    call, cut_short = verl_boundaries.phases(lines)
    assert cut_short == {}
    assert call["total_s"] == pytest.approx(sum(call[f"{phase}_s"] for phase in verl_grpo.PHASES))
    assert all(call[f"{phase}_s"] >= 0 for phase in verl_grpo.PHASES)
    assert call["trainer_offload_host_rss_bytes"] == lines[3]["host_rss_bytes"]


def test_boundaries_out_of_order_or_from_two_processes_are_not_a_call() -> None:
    def line(head: int, t: float, pid: int = 1) -> dict[str, Any]:
        return {"head": verl_boundaries.HEADS[head], "t": t, "pid": pid, "host_rss_bytes": 10 * head}

    whole = [line(i, t) for i, t in enumerate((0.0, 0.5, 2.0, 2.25, 3.0))]
    assert verl_boundaries.phases(whole) == [
        {
            "total_s": 3.0,
            "wake_weights_s": 0.5,
            "sync_s": 1.5,
            "trainer_offload_s": 0.25,
            "barrier_kv_wake_s": 0.75,
            **{f"{phase}_host_rss_bytes": 10 * (i + 1) for i, phase in enumerate(verl_grpo.PHASES)},
        }
    ]
    skipped = [line(0, 0.0), line(2, 1.0)] + whole[1:]  # a boundary missing
    other_pid = whole[:2] + [line(2, 2.0, pid=2)] + whole[3:]
    assert verl_boundaries.phases(skipped) == [{}] and verl_boundaries.phases(other_pid) == [{}]
    cut_then_whole = verl_boundaries.phases(whole[:3] + whole)  # the cut call keeps its place: steps stay aligned
    assert cut_then_whole[0] == {} and cut_then_whole[1]["total_s"] == 3.0 and len(cut_then_whole) == 2


def test_both_modes_phases_come_out_under_the_same_names_side_by_side(tmp_path: Path) -> None:
    lines = [
        {"head": head, "t": t, "pid": 7, "host_rss_bytes": 5 << 30, "device_free_bytes": free << 30}
        for head, t, free in zip(verl_boundaries.HEADS, (10.0, 10.5, 12.0, 12.5, 13.0), (70, 68, 60, 66, 40))
    ]
    (tmp_path / "naive.boundaries.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    manager = {
        f"refitkit/update_weights/{key}": value
        for key, value in {
            "wake_weights_s": 0.25,
            "sync_s": 0.5,
            "trainer_offload_s": 0.125,
            "barrier_s": 0.0625,
            "kv_wake_s": 0.5,
            "total_s": 1.5,
            "trainer_host_rss_bytes_max": 4.0 * (1 << 30),
            "trainer_device_free_bytes_max": 61.0 * (1 << 30),
        }.items()
    }
    (tmp_path / "refitkit.refitkit.jsonl").write_text(json.dumps({"step": None, "metrics": manager}) + "\n")
    results = {
        mode: {"returncode": 0, "wall_s": 10.0, "steps": verl_grpo.collect(tmp_path, mode)}
        for mode in ("naive", "refitkit")
    }
    naive, refit = results["naive"]["steps"][0]["phases"], results["refitkit"]["steps"][0]["phases"]
    assert results["naive"]["steps"][0]["step"] == results["refitkit"]["steps"][0]["step"] == 0
    assert naive["sync_s"] == 1.5 and naive["barrier_kv_wake_s"] == 0.5 and naive["total_s"] == 3.0
    assert naive["trainer_offload_device_free_bytes"] == 66 << 30 and naive["kv_wake_took_bytes"] == 26 << 30
    assert refit == {
        "wake_weights_s": 0.25,
        "sync_s": 0.5,
        "trainer_offload_s": 0.125,
        "barrier_kv_wake_s": 0.5625,
        "total_s": 1.5,
        "trainer_offload_host_rss_bytes": 4.0 * (1 << 30),
        "trainer_offload_device_free_bytes": 61.0 * (1 << 30),
    }
    text = verl_grpo.table(results)
    assert "| step | wake_weights_s (naive) | wake_weights_s (refitkit) | sync_s (naive) | sync_s (refitkit) |" in text
    assert "| 0 | 0.5 | 0.25 | 1.5 | 0.5 | 0.5 | 0.125 | 0.5 | 0.5625 | 3 | 1.5 |" in text


def test_it_runs_as_a_script_from_anywhere(tmp_path: Path) -> None:
    """As the GPU machine runs it: ``python benchmarks/verl_grpo.py`` (the script's folder first on sys.path, not the
    checkout), from another folder."""
    import subprocess
    import sys

    script = Path(verl_grpo.__file__).resolve()
    done = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path / "out"), "--work", str(tmp_path), "--print-overrides"],
        cwd=tmp_path,
        env={k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    naive, refit = done.stdout.splitlines()
    assert f"actor_rollout_ref.model.external_lib={verl_grpo.BOUNDARIES_MODULE}" in naive.split()
    assert f"actor_rollout_ref.model.external_lib={verl_grpo.MODULE}" in refit.split()


@pytest.mark.parametrize("mode", ["naive", "refitkit"])
def test_verls_own_run_gets_as_far_as_its_check_for_gpus(mode: str, tmp_path: Path) -> None:
    """The benchmark's own command, verl's ``main_ppo`` with its own Ray, on this CPU machine: through hydra's config,
    the driver's and TaskRunner's imports (``external_lib`` included), the prompts, tokenizer and reward file, and
    the trainer's construction, to the first thing that needs a GPU (verl's resource pool)."""
    import subprocess
    import sys

    work = tmp_path / "work"
    verl_grpo.write_checkpoint(work / "qwen3-0.6b-shaped", layers=2)  # the script reuses it (the GPU run writes 28)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, verl_grpo.__file__, "--out", str(out), "--work", str(work), "--modes", mode, "--steps", "1"]
        + ["--limit-s", "150", "--ray-cpus", "2"],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / f"{mode}.json").read_text())
    log = (out / f"{mode}.log").read_text(errors="replace")
    assert result["returncode"] == 1 and not result["timed_out"], log[-3000:]
    assert "Total training steps: 1" in log, log[-3000:]
    errors = [
        line for line in log.splitlines() if line.startswith(("ValueError", "ModuleNotFoundError", "ImportError"))
    ]
    assert errors == ["ValueError: Total available GPUs 0 is less than total desired GPUs 1"], log[-3000:]
