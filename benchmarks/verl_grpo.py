"""verl 0.9.1's own GRPO run (``python -m verl.trainer.main_ppo``), twice in one invocation: verl's naive colocated
weight sync, then refitkit selected by configuration alone; each phase's figures side by side.

What it writes first (no network): a random-weight checkpoint of Qwen3-0.6B's widths (hidden 1024, 28 layers,
16/8 heads, head_dim 128, intermediate 3072, tied embeddings; bf16 safetensors) whose vocabulary is that of a small
WordLevel tokenizer built here (``tokenizer.json`` + ``tokenizer_config.json`` with a ChatML template, loaded by
verl's ``hf_tokenizer`` and by vLLM); a synthetic prompt set as parquet in verl's RL dataset format (``data_source``,
``prompt`` as chat messages, ``ability``, ``reward_model.ground_truth``, ``extra_info``); a reward function file for
``reward.custom_reward_function.path``.

Then, each mode in its own ``main_ppo`` process with its own Ray: GRPO (``algorithm.adv_estimator=grpo``), one GPU,
FSDP2 actor with param and optimizer offload, no critic, no reference model, colocated vLLM (``free_cache_engine``,
sleep mode), a few steps of a tiny batch, no validation, console + file loggers. ``trainer.use_v1=false`` in both: verl
0.9.1's v1 trainer builds its own naive manager whatever ``checkpoint_manager_class`` says
(``verl/trainer/ppo/v1/trainer_base.py:381-387``). Per mode it collects verl's per-step metrics (its file logger:
``timing_s/update_weights``, ``timing_s/gen``, ``timing_s/step``, ..., ``training/rollout_probs_diff_*``: the
rollout's log-probs of the sampled tokens against the trainer's) and, for refitkit, the manager's ``last_metrics`` per
step (phases, host RSS, device free; ``REFITKIT_VERL_METRICS_FILE``) into ``OUT/<mode>.json`` beside its log
``OUT/<mode>.log``. verl's own path logs no phases: for it, ``benchmarks/verl_boundaries.py`` (its ``external_lib``)
records the boundary lines verl's worker logs inside ``update_weights`` (time, host RSS, device free), and both modes'
phases come out under the same names (``PHASES``). ``OUT/table.md`` puts verl's timings and the phases side by side;
``OUT/timeline.png`` (with matplotlib) draws each step's ``update_weights`` phase by phase, one panel a mode (verl's own
files stay under ``--work``). ``--report-only`` redraws both from ``OUT/<mode>.json`` (on a machine with matplotlib).

On the GPU machine (the vLLM kit and the verl kit installed into /tmp/site, see envs/gpu/verl.txt)::

    PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 python3 benchmarks/verl_grpo.py --out $OUT --steps 4

``--modes naive`` or ``--modes refitkit`` runs one; ``--print-overrides`` prints each mode's command and exits.
``--modes killed,refitkit``: the planted failure, then the next attempt. ``killed`` is the refitkit run whose vLLM worker
kills itself inside its ``--kill-sync``-th sync (``benchmarks/verl_plant.py``); ``OUT/killed.json`` says how long
main_ppo took to end after the kill and which of refitkit's errors its log named first (none: the step did not fail
with refitkit's error). The ``refitkit`` run after it is the attempt that must sync cleanly.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a source checkout

from benchmarks import verl_boundaries  # noqa: E402

MODES = ("naive", "refitkit", "killed")  # killed: refitkit, its rollout worker killed mid-sync (verl_plant.py)
MODULE = "refitkit.integrations.verl"
EXTENSION = "refitkit.integrations.verl.vllm.VerlRefitWorkerExtension"
PLANTED_EXTENSION = "benchmarks.verl_plant.KilledMidSync"
# what verl_plant.KilledMidSync reads in the worker: which of its syncs to kill (1-based), how long into it, and the
# file where it notes the moment of the kill
KILL_SYNC_ENV, KILL_AFTER_ENV, PLANT_FILE_ENV = (
    "REFITKIT_PLANT_KILL_SYNC",
    "REFITKIT_PLANT_KILL_AFTER_S",
    "REFITKIT_PLANT_FILE",
)
METRICS_ENV = "REFITKIT_VERL_METRICS_FILE"  # refitkit.integrations.verl.colocated.METRICS_FILE_ENV
# the naive mode's phases, from verl's own boundary lines (benchmarks/verl_boundaries.py, loaded as external_lib)
BOUNDARIES_MODULE, BOUNDARIES_ENV = "benchmarks.verl_boundaries", "REFITKIT_BENCH_BOUNDARIES_FILE"
# the phases both modes report, in order (refitkit's barrier and KV wake summed: verl's path logs nothing between them)
PHASES = tuple(phase for _, phase in verl_boundaries.BOUNDARIES[1:])  # the phase each boundary line ends
# the table's columns of them: seconds, then what was left after the trainer's offload and what the KV wake took
PHASE_KEYS = (*(f"{phase}_s" for phase in PHASES), "total_s", "trainer_offload_host_rss_bytes")
PHASE_KEYS += ("trainer_offload_device_free_bytes", "kv_wake_took_bytes")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]"]
WORDS = (
    "user assistant system what is plus minus times the sum of and answer number count say repeat add subtract a an one two three "
    "four five six seven eight nine ten please think step by first then so result equals yes no"
).split()
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' "
    "+ '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
REWARD_SOURCE = '''"""Reward for the synthetic prompts: 1 for the right answer among the words, else the share of digit words."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    words = solution_str.split()
    if ground_truth in words:
        return 1.0
    return sum(word.isdigit() for word in words) / max(len(words), 1)
'''


# -- what the run reads: checkpoint, tokenizer, prompts, reward ----------------------------------------------------


def write_tokenizer(path: Path) -> Any:
    """A WordLevel tokenizer over ``SPECIALS``, the numbers 0..199 and ``WORDS``, with a ChatML template; saved as
    ``tokenizer.json`` + ``tokenizer_config.json`` (what verl's ``hf_tokenizer`` and vLLM load). Returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIALS, *map(str, range(200)), *WORDS, "?", ".", ","])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="[UNK]",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return tokenizer


def model_config(tokenizer: Any, layers: int = 28, hidden: int = 1024, intermediate: int = 3072) -> Any:
    """Qwen3-0.6B's widths (``layers``/``hidden``/``intermediate`` smaller only for CPU tests), the vocabulary the
    tokenizer's rounded up to 64."""
    from transformers import Qwen3Config

    vocab = (len(tokenizer) + 63) // 64 * 64
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["Qwen3ForCausalLM"],
        dtype="bfloat16",
    )


def write_checkpoint(path: Path, layers: int = 28, hidden: int = 1024, intermediate: int = 3072, seed: int = 0) -> Path:
    """Tokenizer, ``config.json`` and random bf16 weights (norms 1, the rest N(0, 0.02)) as one safetensors file, named
    as transformers' ``Qwen3ForCausalLM`` names them (on the meta device: nothing is allocated for it)."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3ForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    config = model_config(write_tokenizer(path), layers, hidden, intermediate)
    config.save_pretrained(str(path))
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in Qwen3ForCausalLM(config).state_dict().items()}
    shapes.pop("lm_head.weight", None)  # tied to the embedding
    generator = torch.Generator().manual_seed(seed)
    weights = {
        name: torch.ones(shape, dtype=torch.bfloat16)
        if name.endswith("norm.weight")
        else (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        for name, shape in sorted(shapes.items())
    }
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def write_prompts(path: Path, count: int = 64, seed: int = 0) -> Path:
    """``count`` arithmetic prompts as verl's RL dataset rows, one parquet file."""
    import random

    import pandas as pd

    rng = random.Random(seed)
    rows = []
    for index in range(count):
        a, b = rng.randrange(50), rng.randrange(50)
        rows.append(
            {
                "data_source": "refitkit/synthetic-sum",
                "prompt": [{"role": "user", "content": f"what is {a} plus {b} ? say the answer ."}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": "train", "index": index},
            }
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


def write_reward(path: Path) -> Path:
    path.write_text(REWARD_SOURCE)
    return path


# -- the two runs ---------------------------------------------------------------------------------------------------


def overrides(mode: str, model: str, prompts: str, reward: str, run_dir: str, args: Any) -> list[str]:
    """Hydra overrides of verl 0.9.1's ``ppo_trainer`` config for ``mode`` (``naive``: verl's own path); the metrics
    files and anything verl writes go under ``run_dir``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    common = [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        f"data.train_files={prompts}",
        f"data.val_files={prompts}",
        f"data.train_batch_size={args.batch}",
        "data.max_prompt_length=64",
        f"data.max_response_length={args.response_length}",
        "data.filter_overlong_prompts=false",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.use_remove_padding=false",  # no flash-attn in the kits
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.batch * args.n}",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.actor.use_torch_compile=false",
        "actor_rollout_ref.actor.optim.lr=1e-5",
        "actor_rollout_ref.actor.fsdp_config.param_offload=true",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.n={args.n}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={args.gpu_memory_utilization}",
        "actor_rollout_ref.rollout.free_cache_engine=true",
        "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.batch * args.n}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "reward.num_workers=1",
        f"reward.custom_reward_function.path={reward}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.use_v1=false",
        "trainer.critic_warmup=0",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={args.steps}",
        "trainer.total_epochs=100",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.resume_mode=disable",
        "trainer.logger=[console,file]",
        "trainer.project_name=refitkit_verl_grpo",
        f"trainer.experiment_name={mode}",
        f"trainer.default_local_dir={run_dir}/checkpoints-{mode}",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH={run_dir}/{mode}.verl.jsonl",
    ]
    if args.ray_cpus:  # default: Ray takes every CPU (too few and its actors wait for CPUs, with no error)
        common.append(f"ray_kwargs.ray_init.num_cpus={args.ray_cpus}")
    if mode == "naive":
        return [
            *common,
            f"actor_rollout_ref.model.external_lib={BOUNDARIES_MODULE}",
            f"+ray_kwargs.ray_init.runtime_env.env_vars.{BOUNDARIES_ENV}={run_dir}/{mode}.boundaries.jsonl",
        ]
    knobs = "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.refitkit"
    env = "+ray_kwargs.ray_init.runtime_env.env_vars"
    planted = []
    if mode == "killed":  # the worker's args.kill_sync-th sync (1 is the one before the first step) is its last
        planted = [
            f"{env}.{KILL_SYNC_ENV}={args.kill_sync}",
            f"{env}.{PLANT_FILE_ENV}={run_dir}/{mode}.killed-at",
        ]
    return [
        *common,
        "actor_rollout_ref.rollout.checkpoint_engine.backend=refitkit",
        f"actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module={MODULE}",
        f"+actor_rollout_ref.rollout.checkpoint_manager_class={MODULE}.RefitkitCheckpointManager",
        f"actor_rollout_ref.model.external_lib={MODULE}",
        "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_ENGINE_VENDOR=refitkit",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.{METRICS_ENV}={run_dir}/{mode}.refitkit.jsonl",
        f"+actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls="
        f"{PLANTED_EXTENSION if mode == 'killed' else EXTENSION}",
        f"{knobs}.timeout_s={args.timeout_s}",
        f"{knobs}.barrier_timeout_s={args.timeout_s}",
        f"{knobs}.transport={args.transport}",
        *planted,
    ]


def run_mode(mode: str, argv: list[str], out: Path, run_dir: Path, limit_s: float) -> dict[str, Any]:
    """``python -m verl.trainer.main_ppo argv`` in its own process group (its own Ray), bounded by ``limit_s``, in
    ``run_dir`` (hydra's outputs/ and the metrics files land there: ``out`` gets only the log and the results)."""
    for suffix in ("verl.jsonl", "refitkit.jsonl", "boundaries.jsonl", "killed-at"):
        (run_dir / f"{mode}.{suffix}").unlink(missing_ok=True)
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parent.parent)
    # this checkout's refitkit first (a copy installed into the kits' site may be older); the kits' site after it
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # FlashInfer is not in the kit
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the server's process may have initialised CUDA
    env.setdefault("RAY_DEDUP_LOGS", "0")
    env.setdefault("PYTHONUNBUFFERED", "1")
    log_path = out / f"{mode}.log"
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "verl.trainer.main_ppo", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=run_dir,
            start_new_session=True,
        )
        try:
            returncode = process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
            returncode = None
    wall_s, ended = time.perf_counter() - start, time.time()
    try:  # whatever it left behind (Ray's daemons share its process group)
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _shorten(log_path, keep_bytes=6 << 20)
    return {
        "mode": mode,
        "returncode": returncode,
        "timed_out": returncode is None,
        "wall_s": wall_s,
        "command": ["python", "-m", "verl.trainer.main_ppo", *argv],
        "steps": collect(run_dir, mode),
        **({"plant": planted_outcome(run_dir / f"{mode}.killed-at", log_path, ended)} if mode == "killed" else {}),
    }


def kill_plan(environ: Any) -> tuple[int, float, str | None]:
    """(which sync to kill, 1-based; 0: none), seconds into it, the file to note the kill in: what the planted
    extension (``verl_plant.KilledMidSync``) reads from the worker's ``environ``."""
    sync = int(environ.get(KILL_SYNC_ENV, "0"))
    after_s = float(environ.get(KILL_AFTER_ENV, "0.002"))
    if sync < 0 or not 0 <= after_s < 60:
        raise ValueError(f"{KILL_SYNC_ENV}={sync} must be >= 0 and {KILL_AFTER_ENV}={after_s} in [0, 60)")
    return sync, after_s, environ.get(PLANT_FILE_ENV)


def refitkit_error_names() -> tuple[str, ...]:
    """The names of refitkit's errors, as they cross Ray into the driver's log (``RayTaskError(PeerGone)``, ...)."""
    from refitkit import errors

    return tuple(
        name for name, value in vars(errors).items() if isinstance(value, type) and issubclass(value, errors.RefitError)
    )


def planted_outcome(note: Path, log_path: Path, ended: float) -> dict[str, Any]:
    """What the killed mode showed: when the worker was killed (its note), how long main_ppo took to end after it, and
    the first line of its log naming one of refitkit's errors (None: the step did not fail with refitkit's error)."""
    killed_at = float(note.read_text()) if note.exists() else None
    names, error_line = refitkit_error_names(), None
    with open(log_path, errors="replace") as log:
        for line in log:
            if any(name in line for name in names):
                error_line = line.strip()[:2000]
                break
    return {
        "killed_at": killed_at,
        "ended_after_kill_s": None if killed_at is None else ended - killed_at,
        "refitkit_error": error_line,
    }


def _shorten(path: Path, keep_bytes: int) -> None:
    """Keep the first MiB and the last ``keep_bytes`` of a long log (files that come back are capped)."""
    size = path.stat().st_size
    if size <= keep_bytes + (1 << 20):
        return
    with open(path, "rb") as log:
        head = log.read(1 << 20)
        log.seek(size - keep_bytes)
        tail = log.read()
    path.write_bytes(head + f"\n[... {size - len(head) - len(tail)} bytes cut ...]\n".encode() + tail)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


VERL_KEYS = ("timing_s/", "perf/", "training/rollout_probs_diff", "critic/score/mean", "response_length/mean")


def collect(run_dir: Path, mode: str) -> list[dict[str, Any]]:
    """Per step: verl's logged metrics (timings, memory, the rollout-vs-trainer log-prob diff, reward) and refitkit's
    manager metrics of the ``update_weights`` that closed that step."""
    steps: dict[int, dict[str, Any]] = {}
    for record in _jsonl(run_dir / f"{mode}.verl.jsonl"):
        data = {k: v for k, v in record["data"].items() if k.startswith(VERL_KEYS)}
        steps.setdefault(int(record["step"]), {})["verl"] = data
    for record in _jsonl(run_dir / f"{mode}.refitkit.jsonl"):
        step = record["step"] if record["step"] is not None else 0
        steps.setdefault(int(step), {})["refitkit"] = record["metrics"]
        steps[int(step)]["phases"] = manager_phases(record["metrics"])
    # verl's own path: its calls in order, the first before step 1 (global step 0), then one closing each step
    for step, call in enumerate(verl_boundaries.phases(_jsonl(run_dir / f"{mode}.boundaries.jsonl"))):
        if call:  # an empty record: that call's lines were not all there
            steps.setdefault(step, {})["phases"] = call
    return [{"step": step, **steps[step]} for step in sorted(steps)]


def manager_phases(metrics: dict[str, float]) -> dict[str, float]:
    """refitkit's manager metrics of one ``update_weights`` (``refitkit/update_weights/...``) under the names of
    ``verl_boundaries.phases``: each of PHASES' seconds, ``total_s``, the trainer's host RSS and device free after its
    offload (the max over ranks)."""
    short = {key.rsplit("/", 1)[-1]: value for key, value in metrics.items()}
    record = {f"{phase}_s": short[f"{phase}_s"] for phase in PHASES[:3] if f"{phase}_s" in short}
    if "barrier_s" in short and "kv_wake_s" in short:
        record["barrier_kv_wake_s"] = short["barrier_s"] + short["kv_wake_s"]
    if "total_s" in short:
        record["total_s"] = short["total_s"]
    for key in ("host_rss_bytes", "device_free_bytes"):
        if f"trainer_{key}_max" in short:
            record[f"trainer_offload_{key}"] = short[f"trainer_{key}_max"]
    return record


def table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown: per step, verl's timings for each mode side by side, then refitkit's phases."""
    modes = list(results)
    by_step: dict[int, dict[str, dict[str, Any]]] = {}
    for mode, result in results.items():
        for row in result["steps"]:
            by_step.setdefault(row["step"], {})[mode] = row
    keys = ["timing_s/update_weights", "timing_s/gen", "timing_s/update_actor", "timing_s/step"]
    keys += ["training/rollout_probs_diff_max", "perf/max_memory_allocated_gb"]
    lines = side_by_side("verl", keys, modes, by_step)
    if any("phases" in row for rows in by_step.values() for row in rows.values()):
        lines += [
            "",
            "update_weights phase by phase (seconds; host RSS and device free bytes after the trainer's offload; "
            "device bytes the KV wake took). verl's own path is timed inside the trainer's worker, refitkit's on the "
            "driver (Ray's round trips included): compare whole calls by timing_s/update_weights above.",
            "",
            *side_by_side("phases", PHASE_KEYS, modes, by_step),
        ]
    phase_rows = [
        (step, row["refitkit"])
        for step in sorted(by_step)
        for row in [by_step[step].get("refitkit", {})]
        if "refitkit" in row
    ]
    if phase_rows:
        names = sorted({k.rsplit("/", 1)[-1] for _, m in phase_rows for k in m})
        lines += ["", "refitkit's manager, per update_weights (`refitkit/update_weights/<name>`):", ""]
        lines += ["| step | " + " | ".join(names) + " |", "|---" * (1 + len(names)) + "|"]
        for step, metrics in phase_rows:
            short = {k.rsplit("/", 1)[-1]: v for k, v in metrics.items()}
            lines.append(f"| {step} | " + " | ".join(f"{short[n]:.4g}" if n in short else "" for n in names) + " |")
    for mode, result in results.items():
        lines.append(f"\n{mode}: returncode {result['returncode']}, wall {result['wall_s']:.1f} s")
        if "plant" in result:
            plant = result["plant"]
            lines.append(
                f"  the rollout worker killed mid-sync: main_ppo ended {plant['ended_after_kill_s']} s after the kill; "
                f"refitkit's error: {plant['refitkit_error']}"
            )
    return "\n".join(lines) + "\n"


def side_by_side(part: str, keys: Sequence[str], modes: list[str], by_step: dict[int, dict[str, Any]]) -> list[str]:
    """Markdown table lines: a row a step, a column a (key, mode), values from each step's row ``part``."""
    lines = [
        "| step | " + " | ".join(f"{key} ({mode})" for key in keys for mode in modes) + " |",
        "|---" * (1 + len(keys) * len(modes)) + "|",
    ]
    for step in sorted(by_step):
        values = [by_step[step].get(mode, {}).get(part, {}).get(key) for key in keys for mode in modes]
        lines.append(f"| {step} | " + " | ".join("" if v is None else f"{v:.4g}" for v in values) + " |")
    return lines


def timeline_segments(results: dict[str, dict[str, Any]]) -> list[tuple[str, int, str, float, float]]:
    """(mode, step, phase, start, seconds): each ``update_weights`` laid out phase after phase from 0, every mode and
    step that has phases."""
    segments = []
    for mode, result in results.items():
        for row in result["steps"]:
            start = 0.0
            for phase in PHASES:
                seconds = row.get("phases", {}).get(f"{phase}_s")
                if seconds is None:
                    continue
                segments.append((mode, row["step"], phase, start, seconds))
                start += seconds
    return segments


def timeline(results: dict[str, dict[str, Any]], path: Path) -> bool:
    """A PNG of ``timeline_segments``: one panel a mode, one bar a step, the phases in order along it; False (nothing
    written) without matplotlib or phases."""
    segments = timeline_segments(results)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if not segments:
        return False
    modes = list(dict.fromkeys(mode for mode, *_ in segments))
    colours = dict(zip(PHASES, ("#9aa5b1", "#2f6fb0", "#e08a2c", "#4f9a57")))
    steps = sorted({step for _, step, *_ in segments})
    figure, axes = plt.subplots(
        len(modes), 1, sharex=True, squeeze=False, figsize=(9, 1.0 + 0.4 * len(steps) * len(modes))
    )
    for axis, mode in zip(axes[:, 0], modes):
        for _, step, phase, start, seconds in (s for s in segments if s[0] == mode):
            axis.barh(step, seconds, left=start, color=colours[phase], edgecolor="white", height=0.7, label=phase)
        axis.set_title(f"{mode}: update_weights, phase by phase", fontsize=9, loc="left")
        axis.set_yticks(steps)
        axis.set_ylabel("step")
        axis.invert_yaxis()
    handles, labels = axes[0, 0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    figure.legend(unique.values(), unique.keys(), loc="upper right", fontsize=8, ncol=len(unique))
    axes[-1, 0].set_xlabel("seconds since update_weights began")
    figure.tight_layout(rect=(0, 0, 1, 0.95))
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def report(results: dict[str, dict[str, Any]], out: Path) -> None:
    """``table.md`` and, with matplotlib, ``timeline.png`` in ``out``."""
    text = table(results)
    (out / "table.md").write_text(text)
    drawn = timeline(results, out / "timeline.png")
    print(text)
    print(f"timeline: {out / 'timeline.png' if drawn else 'not drawn (no matplotlib or no phases)'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="results folder: <mode>.json, <mode>.log, table.md")
    parser.add_argument(
        "--work", default="/tmp/rk-verl-grpo", help="checkpoint, prompts, reward file (reused); run/: verl's files"
    )
    parser.add_argument("--modes", default="naive,refitkit")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="prompts per step (data.train_batch_size)")
    parser.add_argument("--n", type=int, default=4, help="responses per prompt (rollout.n)")
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--timeout-s", type=float, default=60.0, help="refitkit's timeout_s and barrier_timeout_s")
    parser.add_argument("--transport", default="auto", choices=("auto", "shm", "cuda_ipc"))
    parser.add_argument("--ray-cpus", type=int, default=0, help="ray_init.num_cpus (0: all)")
    parser.add_argument("--limit-s", type=float, default=270.0, help="each mode's main_ppo is killed after this")
    parser.add_argument(
        "--kill-sync", type=int, default=2, help="killed mode: the rollout worker's sync to die in (1: before step 1)"
    )
    parser.add_argument("--print-overrides", action="store_true")
    parser.add_argument("--report-only", action="store_true", help="table.md and timeline.png from OUT/<mode>.json")
    args = parser.parse_args()
    out, work = Path(args.out).resolve(), Path(args.work).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model, prompts, reward = work / "qwen3-0.6b-shaped", work / "prompts.parquet", work / "reward.py"
    run_dir = work / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    modes = [m for m in args.modes.split(",") if m]
    if args.report_only:
        report({mode: json.loads((out / f"{mode}.json").read_text()) for mode in modes}, out)
        return
    if args.print_overrides:
        for mode in modes:
            print(
                " ".join(
                    [
                        "python -m verl.trainer.main_ppo",
                        *overrides(mode, str(model), str(prompts), str(reward), str(run_dir), args),
                    ]
                )
            )
        return
    began = time.perf_counter()
    if not (model / "model.safetensors").exists():
        write_checkpoint(model)
    if not prompts.exists():
        write_prompts(prompts)
    write_reward(reward)
    print(f"inputs ready in {work} ({time.perf_counter() - began:.1f} s)", flush=True)
    results = {}
    for mode in modes:
        argv = overrides(mode, str(model), str(prompts), str(reward), str(run_dir), args)
        results[mode] = run_mode(mode, argv, out, run_dir, args.limit_s)
        (out / f"{mode}.json").write_text(json.dumps(results[mode], indent=1, sort_keys=True))
        print(
            f"{mode}: rc {results[mode]['returncode']}, {len(results[mode]['steps'])} steps logged, "
            f"{results[mode]['wall_s']:.0f} s",
            flush=True,
        )
    report(results, out)


if __name__ == "__main__":
    main()
