"""A trainer and a live GPU vLLM engine on one GPU, through the whole RL loop, with the engine's memory driven.

An ``FSDPAdapter`` over a Hugging Face Qwen3 model (Qwen3-0.6B or -8B shapes, random bf16 weights, written
as a local checkpoint first) with AdamW, and a GPU vLLM engine of that checkpoint with sleep mode, made
with ``RefitWorkerExtension`` and fed through ``VllmLink(sleep_level=...)`` over CUDA IPC. Each step:

    generate → resume (engine sleeps, trainer state back) → train step →
    refit (wake weights, sync, offload, flush, barrier, wake KV cache) → generate

It prints each phase's ms, device free memory at every boundary (NVML), the KV-cache bytes the
engine got back, the bytes the sender kept after its sync, and checks every step that every engine
parameter equals the trainer's (``tensor_fingerprint`` of each, q/k/v and gate/up stacked as vLLM
stacks them; ``--sha256`` also compares full sha256 digests on the last step). Measured in the same
run: the flat pinned D2H rate (``benchmarks/limits.py``), against which the refit is held:
``refit / (trainer state bytes / D2H rate)``.

    VLLM_WORKER_MULTIPROC_METHOD=spawn python benchmarks/colocated_loop.py --models 0.6b,8b --steps 4

``--checkpoint DIR`` keeps each model's checkpoint in ``DIR/qwen3-<model>`` and reuses it in later runs (the same
seed gives the same weights; 8B is 16 GB to write): what ``benchmarks/ab.py`` passes to every run of an A/B.

Mixture-of-Experts: ``--models 30b-a3b`` is a transformers 5 ``Qwen3MoeForCausalLM`` of Qwen3-30B-A3B's widths
(hidden 2048, 128 experts, top-8, expert width 768, GQA 32/4, head_dim 128; random bf16 weights) with as many of its
48 layers as fit one 80 GB H100 (``--layers N`` to choose; the estimate and its arithmetic are printed first). It
holds its experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H]); what it pushes is ``FSDPAdapter.named_weights()``,
the checkpoint's per-expert names as views of the fused tensors, and the engine's parameters are checked against that
stream stacked as vLLM stacks it (``w13_weight`` / ``w2_weight``). ``--quantization fp8`` serves the same bf16
checkpoint with vLLM's online FP8 (weights re-quantized as they arrive). Every sync is also held against the one-copy
floor of its bytes (one D2D copy at the rate measured in the same run, ``benchmarks/limits.py``), with the engine's
load path, its tensor counts and its time split into receiving and the rest (layerwise: vLLM's reload, FP8's
re-quantization). ``--models 30b-a3b-tiny`` is the same path at toy widths; ``--dry-run`` (no GPU, no vLLM) builds a
MoE model (30b-a3b on the meta device), writes its checkpoint, checks the stream against it and prints the plan.

    VLLM_WORKER_MULTIPROC_METHOD=spawn python benchmarks/colocated_loop.py --models 30b-a3b --steps 3 --pushes 6 \
        --checkpoint /tmp/rk-checkpoints [--quantization fp8]
    python benchmarks/colocated_loop.py --models 30b-a3b-tiny,30b-a3b --dry-run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from a source checkout

from benchmarks.limits import measure_copy_limits  # noqa: E402
from benchmarks.shapes import (  # noqa: E402
    QWEN3_0_6B,
    QWEN3_8B,
    QWEN3_30B_A3B,
    QWEN3_MOE_TINY,
    DecoderConfig,
    MoeDecoderConfig,
    moe_layer_params,
    moe_outer_params,
)

MODELS: dict[str, DecoderConfig] = {"0.6b": QWEN3_0_6B, "8b": QWEN3_8B}
MOE_MODELS: dict[str, MoeDecoderConfig] = {"30b-a3b": QWEN3_30B_A3B, "30b-a3b-tiny": QWEN3_MOE_TINY}
PROMPTS = [[1 + (7 * i + j) % 1000 for j in range(32)] for i in range(8)]
TIMEOUT_S = 300.0


def nvml_free_bytes() -> int:
    """Device 0's free memory as the driver sees it (every process's allocations, the engine's too)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).free)
    finally:
        pynvml.nvmlShutdown()


def d2h_timeline(trace_path: str) -> dict:
    """The trainer's device-to-host copies in a refit's profiler trace, against the refit's phases.

    Per phase window: the bytes its D2H copies moved (a copy that straddles a boundary is split by time) and
    their rate; over the whole refit: when the first copy started and the last ended, the union of copy time,
    and every idle gap of the copy stream over 0.2 ms with the phase it fell in. Says where a refit loses
    time against the flat D2H (the copies stalled, or work ran after them)."""
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    phases = sorted(
        (event["ts"], event["ts"] + event["dur"], event["name"].removeprefix("refitkit."))
        for event in events
        if event.get("cat") == "user_annotation" and event.get("name", "").startswith("refitkit.") and "dur" in event
    )
    copies = sorted(
        (event["ts"], event["ts"] + event["dur"], int(event.get("args", {}).get("bytes", 0)))
        for event in events
        if event.get("cat") == "gpu_memcpy" and "DtoH" in event.get("name", "") and "dur" in event
    )
    if not phases or not copies:
        return {"copies": len(copies), "phases": len(phases)}
    origin, end = min(start for start, _, _ in phases), max(stop for _, stop, _ in phases)

    def phase_at(time_us: float) -> str:
        inside = [name for start, stop, name in phases if start <= time_us < stop and name != "offload_start"]
        return inside[-1] if inside else "between phases"

    windows = {}
    for start, stop, name in phases:
        moved = sum(nbytes * max(0.0, min(stop, b) - max(start, a)) / max(b - a, 1e-3) for a, b, nbytes in copies)
        windows[name] = {
            "ms": round((stop - start) / 1e3, 2),
            "d2h_gb": round(moved / 1e9, 3),
            "d2h_gbps": round(moved / 1e3 / max(stop - start, 1e-3), 1),
        }
    busy_us, gaps, cursor = 0.0, [], copies[0][0]
    for start, stop, _ in copies:
        if start > cursor + 200:
            gaps.append(
                {
                    "at_ms": round((cursor - origin) / 1e3, 2),
                    "ms": round((start - cursor) / 1e3, 2),
                    "phase": phase_at(cursor),
                }
            )
        busy_us += max(0.0, stop - max(start, cursor))
        cursor = max(cursor, stop)
    total = sum(nbytes for _, _, nbytes in copies)
    return {
        "copies": len(copies),
        "d2h_gb": round(total / 1e9, 3),
        "first_copy_at_ms": round((copies[0][0] - origin) / 1e3, 2),
        "last_copy_end_at_ms": round((cursor - origin) / 1e3, 2),
        "refit_end_at_ms": round((end - origin) / 1e3, 2),
        "copy_busy_ms": round(busy_us / 1e3, 2),
        "busy_gbps": round(total / 1e3 / max(busy_us, 1e-3), 1),
        "gaps": gaps[:40],
        "windows": windows,
    }


def hf_model(config: DecoderConfig) -> torch.nn.Module:
    """A Hugging Face Qwen3 causal LM with ``config``'s shapes, random bf16 weights, on the GPU."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hf_config = Qwen3Config(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        tie_word_embeddings=config.tie_word_embeddings,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(hf_config).to(torch.bfloat16)
    return model


def hf_moe_model(config: MoeDecoderConfig, layers: int, device: str = "cuda") -> torch.nn.Module:
    """A transformers 5 Qwen3-MoE causal LM of ``config``'s widths and ``layers`` layers, random bf16 weights (seeded),
    made in bf16 on ``device`` (``meta``: shapes only, for a plan)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hf_config = Qwen3MoeConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        moe_intermediate_size=config.moe_intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=4096,
        tie_word_embeddings=config.tie_word_embeddings,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # made in bf16: no float32 model first (30B-A3B: 4 bytes a param)
    try:
        with torch.device(device):
            model = Qwen3MoeForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(default_dtype)
    return model


# What an 80 GB H100 holds, as torch reports its total capacity: the default --layers is sized for it on any card,
# so that runs on H100 and H200 compare.
H100_TOTAL_BYTES = int(79.1 * 2**30)
PROCESS_BYTES = 2 << 30  # two CUDA contexts (trainer, engine) with their cuBLAS workspaces
ENGINE_ACTIVATION_BYTES = 3 << 30  # vLLM's profiled activations and non-torch memory, inside its budget
LAYERWISE_LAYERS = 3  # a layerwise reload holds a layer's clones, its rebuilt bf16 tensors and the quantizer's work


def layers_that_fit(
    config: MoeDecoderConfig, *, utilization: float, bucket_bytes: int, total_bytes: int = H100_TOTAL_BYTES
) -> tuple[int, dict]:
    """How many of ``config``'s layers fit one GPU of ``total_bytes`` through the whole benchmark, and the arithmetic.

    The peak is the --pushes phase: the trainer's whole state (bf16 params and grads, AdamW's two states in the
    params' dtype, as torch keeps them: 8 bytes a param; fused AdamW makes no temporaries) beside the serving engine's
    whole budget (``utilization`` of the device), plus both processes' contexts, the sender's bucket and what the
    engine's layerwise reload holds beyond its budget. The engine's bf16 weights (and its activations) must also fit
    its budget. The refit's own peak (trainer state and the engine's weights, KV cache asleep) is lower than both."""
    param_bytes = 2  # bf16
    trainer_bytes_per_param = 2 * param_bytes + 2 * param_bytes  # params, grads; exp_avg, exp_avg_sq
    per_layer, outer = moe_layer_params(config), moe_outer_params(config)
    engine_budget = int(utilization * total_bytes)
    fixed = PROCESS_BYTES + bucket_bytes + LAYERWISE_LAYERS * per_layer * param_bytes
    by_trainer = (total_bytes - engine_budget - fixed) // trainer_bytes_per_param
    by_engine = (engine_budget - ENGINE_ACTIVATION_BYTES) // param_bytes
    params = min(by_trainer, by_engine)
    layers = max(0, min(config.num_hidden_layers, (params - outer) // per_layer))
    arithmetic = {
        "total_gib": round(total_bytes / 2**30, 2),
        "params_per_layer": per_layer,
        "params_outside_layers": outer,
        "trainer_bytes_per_param": trainer_bytes_per_param,
        "engine_budget_gib": round(engine_budget / 2**30, 2),
        "fixed_gib": round(fixed / 2**30, 2),
        "params_by_trainer": by_trainer,
        "params_by_engine": by_engine,
        "layers": layers,
        "how": (
            f"{trainer_bytes_per_param} B/param x (outer {outer / 1e9:.3f} B + L x {per_layer / 1e9:.4f} B params) "
            f"<= {total_bytes / 2**30:.1f} GiB - engine budget {utilization:g} x total ({engine_budget / 2**30:.1f} GiB)"
            f" - contexts {PROCESS_BYTES / 2**30:.0f} GiB - bucket {bucket_bytes / 2**30:g} GiB - layerwise reload "
            f"{LAYERWISE_LAYERS} x {per_layer * param_bytes / 2**30:.2f} GiB; and bf16 weights + "
            f"{ENGINE_ACTIVATION_BYTES / 2**30:.0f} GiB activations <= the engine budget"
        ),
    }
    return layers, arithmetic


def moe_layers(key: str, layers: int | None, *, utilization: float, bucket_bytes: int) -> tuple[int, dict | None]:
    """The layers a MoE model gets: ``layers`` if given; the tiny one its own count; 30B-A3B what fits an H100."""
    config = MOE_MODELS[key]
    if key != "30b-a3b":
        return layers or config.num_hidden_layers, None
    fit, arithmetic = layers_that_fit(config, utilization=utilization, bucket_bytes=bucket_bytes)
    print(f"[{key}] layers that fit one 80 GB H100: {fit} ({arithmetic['how']})", flush=True)
    if layers is not None and layers > fit:
        print(f"[{key}] --layers {layers} is more than the estimate ({fit}): it may not fit an 80 GB H100", flush=True)
    if fit < 1 and layers is None:
        raise SystemExit(f"[{key}] not one layer fits at --gpu-memory-utilization {utilization:g}; pass --layers")
    return layers or fit, arithmetic


# the fields of a saved config.json that must match for a checkpoint to be reused
SHAPE_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "max_position_embeddings",
    "num_experts",  # (transformers 5 saves it as num_local_experts)
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)


def checkpoint_of(model: torch.nn.Module, key: str, reuse_in: str | None) -> str:
    """The directory vLLM loads ``model`` from: a fresh temporary one, or ``reuse_in/qwen3-<key>``, written there once
    and reused by later runs (``hf_model`` seeds its weights, so a reused checkpoint holds the same ones)."""
    if reuse_in is None:
        path = tempfile.mkdtemp(prefix=f"rk-colocated-{key}-")
        model.save_pretrained(path, safe_serialization=True)
        return path
    root = Path(reuse_in)
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"qwen3-{key}"
    if path.is_dir():
        saved = json.loads((path / "config.json").read_text())
        wanted = model.config.to_dict()
        differ = [field for field in SHAPE_FIELDS if saved.get(field) != wanted.get(field)]
        if differ:
            raise SystemExit(
                f"--checkpoint {reuse_in}: {path} holds another shape ({', '.join(differ)} differ from {key}'s); "
                "remove it or pass another directory"
            )
        return str(path)
    for stale in root.glob(f".qwen3-{key}-*"):  # what a killed run was writing (8B: up to 16 GB each)
        shutil.rmtree(stale, ignore_errors=True)
    staging = tempfile.mkdtemp(prefix=f".qwen3-{key}-", dir=root)
    model.save_pretrained(staging, safe_serialization=True)
    os.rename(staging, path)  # whole or absent: a run killed while writing leaves nothing to reuse
    return str(path)


def rank_reports(push) -> list[dict]:
    """Each engine rank's report of a push: ``PushStats.ranks``, or ``workers`` in refitkit before 802a45b (the
    A/B's base, 35ec2da, runs these same scripts)."""
    return push.ranks if hasattr(push, "ranks") else push.workers


def split_cores(
    cpus: set[int] | None = None, sysfs: str = "/sys/devices/system/cpu"
) -> tuple[set[int], set[int]] | None:
    """``cpus`` (default: those this process may run on) split by physical core, from sysfs's topology: (the CPUs of
    every core but the last, the last core's CPUs, its hardware threads); None where there are fewer than two cores or
    no topology to read."""
    cores: dict[tuple[str, str], set[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0) if cpus is None else cpus):
        topology = Path(sysfs) / f"cpu{cpu}" / "topology"
        try:
            core = ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text().strip())
        except OSError:
            return None
        cores.setdefault(core, set()).add(cpu)
    if len(cores) < 2:
        return None
    *rest, last = cores.values()
    return set().union(*rest), last


def pin_hot_threads(llm) -> dict[str, list[int]] | None:
    """Keep the two threads a sync runs on, this process's (the sender's) and the vLLM worker's (its receiver's: the
    thread collective_rpc runs on), off each other's physical core: the worker's thread on the last core (threads it
    starts later, the receiver's ZMQ I/O thread among them, inherit that core's hardware threads), this one on the
    others. Without it a run's figure depends on whether the scheduler puts both on one core's two hardware threads."""
    split = split_cores()
    if split is None:
        return None
    trainer, worker = split
    os.sched_setaffinity(0, trainer)  # (Linux: the calling thread, and the threads it starts from now on)
    llm.collective_rpc(_pin_worker_thread, args=(sorted(worker),))
    return {"trainer": sorted(trainer), "worker": sorted(worker)}


def _pin_worker_thread(worker, cpus: list[int]) -> None:  # runs inside the vLLM worker (collective_rpc of a function)
    os.sched_setaffinity(0, set(cpus))


def generate_ms(llm) -> float:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt} for prompt in PROMPTS], params, use_tqdm=False)
    return (time.perf_counter() - start) * 1e3


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> float:
    batch = torch.tensor(PROMPTS[:2], device="cuda")
    start = time.perf_counter()
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # grads stay: the offload moves (drops) them like a real step's
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def bench_model(
    key: str,
    *,
    steps: int,
    bucket_bytes: int,
    sleep_level: int,
    utilization: float,
    sha256: bool,
    eager: bool,
    overlap: bool,
    pushes: int = 0,
    profile: str | None = None,
    optimizer_impl: str = "foreach",
    zero_grads: bool = False,
    direct: bool = True,
    push_paths: list[str] | None = None,
    trace: str | None = None,
    checkpoint_in: str | None = None,
    layers: int | None = None,
    quantization: str | None = None,
    pin_cpus: bool = False,
) -> dict:
    from vllm import LLM

    from refitkit.engines.fsdp import FSDPAdapter
    from refitkit.refit import RefitCycle
    from refitkit.rollout import VllmLink, clean_weight_version
    from refitkit.transfer import BucketedWeightSender

    moe = key in MOE_MODELS
    if moe:
        layers, _ = moe_layers(key, layers, utilization=utilization, bucket_bytes=bucket_bytes)
        model = hf_moe_model(MOE_MODELS[key], layers)
        checkpoint = checkpoint_of(model, f"{key}-{layers}l", checkpoint_in)
    else:
        model = hf_model(MODELS[key])
        checkpoint = checkpoint_of(model, key, checkpoint_in)
    llm = LLM(
        model=checkpoint,
        dtype="bfloat16",
        seed=0,
        max_model_len=1024,
        gpu_memory_utilization=utilization,
        enable_sleep_mode=True,
        skip_tokenizer_init=True,
        enforce_eager=eager,
        worker_extension_cls="refitkit.rollout.vllm.RefitWorkerExtension",
        quantization=quantization,  # fp8: the bf16 checkpoint quantized on load, and again on every sync
    )
    pinned = pin_hot_threads(llm) if pin_cpus else None
    # foreach (torch's default on CUDA) makes a param-sized temporary per param in every step: after a flush each is
    # its own segment, which the next flush returns; fused makes none
    fused = optimizer_impl == "fused"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=not fused, fused=fused)
    limits = measure_copy_limits(1 << 30)
    rows = []
    memory_log: list[tuple[str, int]] = []
    reserved: dict[str, int] = {}  # this process's reserved bytes before the refit and after its sync

    segments_log: list[tuple[str, int]] = []  # this process's allocator segments at each boundary (a flush frees them)

    def on_phase(phase: str) -> None:
        reserved[phase] = torch.cuda.memory_reserved()
        memory_log.append((phase, nvml_free_bytes()))
        segments_log.append((phase, torch.cuda.memory_stats().get("segment.all.current", 0)))

    with BucketedWeightSender(
        f"colocated-{key}", bucket_bytes=bucket_bytes, transport="cuda_ipc", timeout_s=TIMEOUT_S, direct=direct
    ) as sender:
        link = VllmLink(llm, sender, sleep_level=sleep_level, engine_timeout_s=TIMEOUT_S)
        adapter = FSDPAdapter(model, optimizer, zero_grads=zero_grads)
        # what a user pushes: a MoE model's checkpoint names (per-expert views of its fused experts) come from the
        # adapter; a dense Qwen3's own parameters already are the checkpoint's
        trainer_weights = adapter.named_weights if moe else model.named_parameters
        from refitkit.rollout.vllm import stacked_digests, tensor_fingerprint, tensor_sha256

        engine_before = llm.collective_rpc("refit_fingerprints")[0] if quantization else {}
        with RefitCycle(adapter, link, on_phase=on_phase, overlap=overlap) as cycle:
            for step in range(steps):
                memory_log.clear()
                row: dict = {"model": key, "step": step, "generate_ms": generate_ms(llm)}
                memory_log.append(("generate", nvml_free_bytes()))
                if step == 0:  # the trainer's state is still on the device: only the engine goes to sleep
                    start = time.perf_counter()
                    link.sleep_for_training()
                    row["resume_ms"] = (time.perf_counter() - start) * 1e3
                    memory_log.append(("engine_sleep", nvml_free_bytes()))
                else:
                    resumed = cycle.resume(step)
                    row["resume_ms"] = sum(phase.seconds for phase in resumed.phases) * 1e3
                    row.update({f"{phase.name}_ms": phase.seconds * 1e3 for phase in resumed.phases})
                row["train_ms"] = train_step(model, optimizer)
                memory_log.append(("train_step", nvml_free_bytes()))
                expected = stacked_digests(dict(trainer_weights()), tensor_fingerprint)
                last_sha = sha256 and step == steps - 1 and not quantization
                expected_sha = stacked_digests(dict(trainer_weights()), tensor_sha256) if last_sha else None
                reserved.clear()
                reserved["before"] = torch.cuda.memory_reserved()
                segments_log.clear()
                segments_log.append(("before", torch.cuda.memory_stats().get("segment.all.current", 0)))
                reserved_before_gib = torch.cuda.memory_reserved() / 2**30
                kv_asleep = llm.collective_rpc("refit_memory")[0]["asleep"].get("kv_cache", 0)
                traced = trace is not None and step == steps - 1
                if traced:  # the last step's refit under the profiler (CUDA activity): a diagnosis, not the figure
                    from torch.profiler import ProfilerActivity
                    from torch.profiler import profile as torch_profile  # (``profile`` is this function's argument)

                    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
                        report = cycle.refit(step)
                    Path(trace).mkdir(parents=True, exist_ok=True)
                    trace_path = str(Path(trace) / f"refit-{key}-step{step}.json")
                    profiler.export_chrome_trace(trace_path)
                    row["d2h_timeline"] = d2h_timeline(trace_path)
                else:
                    report = cycle.refit(step)
                row["traced"] = traced
                row.update({f"{phase.name}_ms": phase.seconds * 1e3 for phase in report.phases})
                first, last = report.phases[0], report.phases[-1]
                row["refit_ms"] = (last.start_s + last.seconds - first.start_s) * 1e3  # wall time of the whole refit
                row["sync_bytes"] = report.phase("sync_weights").bytes
                row.update(against_floor(row["sync_weights_ms"], row["sync_bytes"], limits.d2d_gbps))
                state_bytes = report.phase("offload").bytes
                row["state_gb"] = state_bytes / 1e9
                row["flat_d2h_ms"] = state_bytes / (limits.pinned_d2h_gbps * 1e9) * 1e3
                row["refit_vs_flat_d2h"] = row["refit_ms"] / row["flat_d2h_ms"]
                row["sender_kept_mib"] = (reserved["sync_weights"] - reserved["before"]) / 2**20
                after = llm.collective_rpc("refit_memory")[0]
                row["kv_cache_back_gib"] = after["resident"].get("kv_cache", 0) / 2**30
                row["kv_cache_was_asleep_gib"] = kv_asleep / 2**30
                worker = rank_reports(link.last_push)[0] if link.last_push else {}
                row["load_path"] = worker.get("load_path")
                row.update(worker_split(worker))
                row["split"] = sender.last_split.__dict__ if sender.last_split else None
                row["engine_calls_ms"] = {call: round(seconds * 1e3, 1) for call, seconds in link.call_seconds.items()}
                row["reserved_before_refit_gib"] = round(reserved_before_gib, 1)
                row["segments"] = dict(segments_log)
                held = llm.collective_rpc("refit_fingerprints")[0]
                if quantization:
                    row.update(quantized_check(held, expected, engine_before))
                    engine_before = held
                else:
                    mismatched = sorted(name for name in expected if held.get(name) != expected[name])
                    row["params_equal"] = not mismatched and sorted(held) == sorted(expected)
                    if mismatched:
                        row["mismatched"] = mismatched[:5]
                if expected_sha is not None:
                    row["sha256_equal"] = llm.collective_rpc("refit_checksums")[0] == expected_sha
                row["version"] = clean_weight_version(llm)
                row["generate_after_ms"] = generate_ms(llm)
                row["free_gib"] = {phase: round(free / 2**30, 1) for phase, free in memory_log}
                rows.append(row)
                print(json.dumps(row), flush=True)
        per_model = str(Path(profile) / key) if profile else None  # one directory per model size
        pushes_out = (
            live_pushes(
                llm,
                link,
                cycle,
                trainer_weights,
                steps,
                pushes=pushes,
                profile=per_model,
                paths=push_paths or ["direct"],
                d2d_gbps=limits.d2d_gbps,
                quantized=bool(quantization),
            )
            if pushes
            else []
        )
    llm.llm_engine.engine_core.shutdown()
    del llm
    return {
        "model": key,
        "layers": model.config.num_hidden_layers,
        "params": sum(param.numel() for param in model.parameters()),
        "experts_implementation": getattr(model.config, "_experts_implementation", None) if moe else None,
        "quantization": quantization,
        "overlap": overlap,
        "optimizer": optimizer_impl,
        "zero_grads": zero_grads,
        "direct": direct,
        "limits": limits.__dict__,
        "pinned_cpus": pinned,  # the CPUs of the sender's thread and of the vLLM worker's, or None
        "rows": rows,
        "pushes": pushes_out,
    }


# The receiver's own phases of a session (waiting for the sender's frames and bytes, mapping, releasing); its
# ``on_bucket`` is the loaders' time and ``release_*`` split ``release``, so neither is counted again.
RECEIVER_OWN_PHASES = ("handshake", "frames", "packed", "map", "release", "close")


def worker_split(worker: dict) -> dict:
    """A vLLM worker's side of a push, in ms: the whole of it, its loaders, post-processing, waiting on the sender;
    how it landed (``load_path``; in place: direct copies and the model's loader; layerwise: vLLM's reload of every
    tensor); and the whole split into the receiver's own phases and the rest (``engine_work_ms``: the loaders and
    post-processing in place; layerwise, the clones, vLLM's loaders and its processing of each finished layer, which
    for an FP8 engine is the re-quantization)."""
    receiver_ms = {
        key[len("receiver_") : -len("_s")]: round(value * 1e3, 2)
        for key, value in worker.items()
        if key.startswith("receiver_") and key.endswith("_s") and value
    }
    load_ms = worker.get("load_s", 0.0) * 1e3
    receive_ms = sum(receiver_ms.get(phase, 0.0) for phase in RECEIVER_OWN_PHASES)
    direct, loader, tensors = (worker.get(key) for key in ("direct_tensors", "loader_tensors", "tensors"))
    return {
        "engine_load_ms": load_ms,
        "engine_loader_ms": worker.get("loader_s", 0.0) * 1e3,
        "engine_post_ms": worker.get("post_s", 0.0) * 1e3,
        "engine_session_ms": worker.get("seconds", 0.0) * 1e3,
        "engine_wait_ms": worker.get("ack_wait_s", 0.0) * 1e3,
        "load_path": worker.get("load_path"),
        "tensors": tensors,
        "direct_tensors": direct,
        "loader_tensors": loader,
        "layerwise_tensors": (
            tensors - (direct or 0) - (loader or 0)
            if worker.get("load_path") == "layerwise" and tensors is not None
            else 0
        ),
        "engine_receive_ms": round(receive_ms, 2),
        "engine_work_ms": round(load_ms - receive_ms, 2),
        # the worker's receiver, per phase (BucketedWeightReceiver.last_timings_s, reported as receiver_<phase>_s)
        "engine_receiver_ms": receiver_ms,
    }


def against_floor(sync_ms: float, nbytes: int, d2d_gbps: float) -> dict:
    """A sync against the one-copy floor of its bytes: one device-to-device copy of them at the rate measured in the
    same run (what the direct path's single copy on arrival costs at best)."""
    floor_ms = nbytes / (d2d_gbps * 1e9) * 1e3
    return {"floor_ms": floor_ms, "sync_vs_floor": sync_ms / floor_ms if floor_ms else float("nan")}


def quantized_check(held: dict, expected: dict, before: dict) -> dict:
    """What can be checked of a quantized engine's parameters without a second engine: those it holds unquantized
    (embedding, norms, LM head) equal the trainer's; and how many of its weights changed since ``before``. That its
    quantized weights are exactly a fresh FP8 load of the same weights is tests/engines/vllm/test_vllm_moe.py's check."""
    unquantized = sorted(name for name in expected if held.get(name) == expected[name])
    weights = [name for name in held if name.endswith("weight") and name in before]
    return {
        "params_equal": None,  # not comparable: the engine holds FP8 re-quantized weights
        "engine_params": len(held),
        "equal_to_trainer": len(unquantized),
        "weights_changed": sum(held[name] != before[name] for name in weights),
        "weights_compared": len(weights),
    }


def live_pushes(
    llm,
    link,
    cycle,
    weights,
    step: int,
    *,
    pushes: int,
    profile: str | None,
    paths: list[str],
    d2d_gbps: float,
    quantized: bool = False,
) -> list[dict]:
    """The sync alone into the serving engine (trainer state and the engine's KV cache both resident), ``pushes``
    times: ``link.send(weights())`` (the trainer's weights as it pushes them), as a user's ``push_weights`` between
    two rollouts would run; push ``i`` takes ``paths[i % len(paths)]`` (direct, or bucket: the same sender with
    ``direct=False``). Each against the one-copy floor of its bytes at ``d2d_gbps``."""
    from refitkit.rollout.vllm import stacked_digests, tensor_fingerprint

    refit_held = llm.collective_rpc("refit_fingerprints")[0] if quantized else None

    cycle.resume(step)  # the engine sleeps, the trainer's state comes back
    link.wake_for_rollout()  # then the engine serves again beside it
    out = []
    for index in range(pushes):
        profiled = profile is not None and index == pushes - 1
        if profiled:
            import cProfile

            llm.collective_rpc(_worker_profile_start)
            trainer_profile = cProfile.Profile()
            trainer_profile.enable()
        path = paths[index % len(paths)]
        link.sender.direct = path == "direct"
        torch.cuda.synchronize()
        start = time.perf_counter()
        link.send(weights())
        wall_ms = (time.perf_counter() - start) * 1e3
        if profiled:
            trainer_profile.disable()
            Path(profile).mkdir(parents=True, exist_ok=True)
            _write_profile(trainer_profile, Path(profile) / "trainer_push.txt")
            llm.collective_rpc(_worker_profile_stop, args=(str(Path(profile).resolve() / "worker_push.txt"),))
        worker = rank_reports(link.last_push)[0]
        row = {"push": index, "path": path, "sync_ms": wall_ms, "bytes": worker.get("bytes"), **worker_split(worker)}
        if profiled:
            row["profiled"] = True  # cProfile's own cost is in it: not a sample
        row.update(against_floor(wall_ms, worker.get("bytes", 0), d2d_gbps))
        row["sender_ms"] = {phase: round(seconds * 1e3, 2) for phase, seconds in link.sender.last_timings_s.items()}
        row["split"] = link.sender.last_split.__dict__ if link.sender.last_split else None
        reset_s = link.last_push.reset_s  # the reset queued behind the push: from the stream's end until it came back
        row["reset_prefix_cache_ms"] = None if reset_s is None else round(reset_s * 1e3, 2)
        if index == pushes - 1:
            held = llm.collective_rpc("refit_fingerprints")[0]
            if quantized:  # the same bf16 weights as the last refit's: re-quantized to the same bytes
                row["params_equal"] = None
                row["same_as_after_refit"] = held == refit_held
            else:
                row["params_equal"] = held == stacked_digests(dict(weights()), tensor_fingerprint)
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def _write_profile(profile, path: Path) -> None:
    import io
    import pstats

    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)
    path.write_text(text.getvalue())


def _worker_profile_start(worker) -> None:  # runs inside the vLLM worker (collective_rpc of a function)
    import cProfile

    worker._colocated_profile = cProfile.Profile()
    worker._colocated_profile.enable()


def _worker_profile_stop(worker, path: str) -> None:
    worker._colocated_profile.disable()
    _write_profile(worker._colocated_profile, Path(path))


def print_summary(result: dict) -> None:
    steady = [row for row in result["rows"][1:] if not row.get("traced")] or result["rows"]

    def med(key: str) -> float:
        values = sorted(row[key] for row in steady if key in row)
        return values[len(values) // 2] if values else float("nan")

    name = result["model"] + (f" ({result['layers']} layers)" if result.get("experts_implementation") else "")
    if result.get("quantization"):
        name += f", {result['quantization']} engine"
    rows = result["rows"]
    if result.get("quantization"):
        equal = (
            f"n/a ({result['quantization']}: {rows[-1]['equal_to_trainer']} of {rows[-1]['engine_params']} engine "
            f"params equal the trainer's, the unquantized ones; {rows[-1]['weights_changed']} of "
            f"{rows[-1]['weights_compared']} weights changed by the last refit)"
        )
    else:
        equal = str(all(row["params_equal"] for row in rows))
    print(
        f"{name} (AdamW {result['optimizer']}, zero_grads={result['zero_grads']}): flush {med('flush_device_ms'):.0f} ms, "
        f"sync {med('sync_weights_ms'):.1f} ms (engine load {med('engine_load_ms'):.1f}), refit "
        f"{med('refit_ms'):.0f} ms = {med('refit_vs_flat_d2h'):.3f}x flat D2H of {med('state_gb'):.1f} GB "
        f"({result['limits']['pinned_d2h_gbps']:.1f} GB/s), wake weights {med('engine_wake_weights_ms'):.0f} ms, "
        f"wake KV {med('engine_wake_kv_cache_ms'):.0f} ms, engine sleep {med('engine_sleep_ms'):.0f} ms, "
        f"sender kept {med('sender_kept_mib'):.0f} MiB, params equal every step: {equal}",
        flush=True,
    )
    print(
        f"{name}: sync in the refit {med('sync_weights_ms'):.1f} ms of {med('sync_bytes') / 1e9:.2f} GB = "
        f"{med('sync_vs_floor'):.2f}x the one-copy floor {med('floor_ms'):.1f} ms (D2D "
        f"{result['limits']['d2d_gbps']:.0f} GB/s); load path {rows[-1].get('load_path')}, tensors direct "
        f"{rows[-1].get('direct_tensors')} / loader {rows[-1].get('loader_tensors')} / layerwise "
        f"{rows[-1].get('layerwise_tensors')}",
        flush=True,
    )
    pushes = result.get("pushes") or []
    last_equal = pushes[-1].get("params_equal") if pushes else None
    if pushes and "same_as_after_refit" in pushes[-1]:
        last_equal = f"n/a (quantized; the same bytes as after the last refit: {pushes[-1]['same_as_after_refit']})"
    for path in sorted({row["path"] for row in pushes}):
        of_path = [row for row in pushes if row["path"] == path]
        steady_pushes = of_path[1:] or of_path

        def pmed(key: str) -> float:
            values = sorted(row[key] for row in steady_pushes)
            return values[len(values) // 2]

        print(
            f"{name} ({path}): sync alone into the serving engine {pmed('sync_ms'):.1f} ms = "
            f"{pmed('sync_vs_floor'):.2f}x the one-copy floor of its {pmed('bytes') / 1e9:.2f} GB, "
            f"{pmed('floor_ms'):.1f} ms (min {min(row['sync_vs_floor'] for row in steady_pushes):.2f}x); "
            f"load path {steady_pushes[-1]['load_path']}, tensors direct {steady_pushes[-1]['direct_tensors']} / loader "
            f"{steady_pushes[-1]['loader_tensors']} / layerwise {steady_pushes[-1]['layerwise_tensors']}; worker: "
            f"receiving {pmed('engine_receive_ms'):.1f} ms, the rest {pmed('engine_work_ms'):.1f} ms (layerwise: "
            f"vLLM's reload and re-processing of each layer)",
            flush=True,
        )
        print(
            f"{name} ({path}): sync alone into the serving engine {pmed('sync_ms'):.1f} ms (min "
            f"{min(row['sync_ms'] for row in steady_pushes):.1f}); worker: whole {pmed('engine_load_ms'):.1f}, session "
            f"{pmed('engine_session_ms'):.1f}, loaders {pmed('engine_loader_ms'):.1f}, post {pmed('engine_post_ms'):.1f}, "
            f"waiting on the sender {pmed('engine_wait_ms'):.1f}; params equal after the last push: {last_equal}",
            flush=True,
        )
        phases = sorted({phase for row in steady_pushes for phase in row.get("engine_receiver_ms", {})})
        receiver = {p: sorted(row["engine_receiver_ms"].get(p, 0.0) for row in steady_pushes) for p in phases}
        print(
            f"{name} ({path}): the worker's receiver, median ms per phase: "
            + ", ".join(f"{p} {v[len(v) // 2]:.2f}" for p, v in receiver.items()),
            flush=True,
        )


def saved_weights(checkpoint: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint directory, by name."""
    from safetensors import safe_open

    weights = {}
    for file in sorted(Path(checkpoint).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as opened:
            weights.update({name: opened.get_tensor(name) for name in opened.keys()})  # noqa: SIM118
    return weights


def plan_moe(
    key: str,
    *,
    layers: int | None,
    utilization: float,
    bucket_bytes: int,
    quantization: str | None,
    optimizer_impl: str,
    checkpoint_in: str | None,
) -> dict:
    """``--dry-run`` of a MoE model, without a GPU or vLLM: its layers (the estimate first), the model (30B-A3B on the
    meta device: shapes only; the tiny one on the CPU, its checkpoint written as a run writes it), the stream the
    trainer pushes (``FSDPAdapter.named_weights()``) and, with a checkpoint, that stream equal to it name for name and
    bit for bit; the engine's parameters it is checked against; what the run would start."""
    from refitkit.engines.fsdp import FSDPAdapter
    from refitkit.rollout.vllm import stacked_digests

    layers, arithmetic = moe_layers(key, layers, utilization=utilization, bucket_bytes=bucket_bytes)
    config = MOE_MODELS[key]
    device = "meta" if key == "30b-a3b" else "cpu"
    model = hf_moe_model(config, layers, device=device)
    params = sum(param.numel() for param in model.parameters())
    stream = list(FSDPAdapter(model).named_weights())
    experts = {name for name, _ in stream if ".mlp.experts." in name}
    plan = {
        "model": key,
        "dry_run": True,
        "device": device,
        "layers": layers,
        "fit": arithmetic,
        "params": params,
        "params_by_shapes": moe_outer_params(config) + layers * moe_layer_params(config),
        "weight_bytes": sum(param.numel() * param.element_size() for param in model.parameters()),
        "push_tensors": len(stream),
        "push_expert_tensors": len(experts),
        "push_bytes": sum(tensor.numel() * tensor.element_size() for _, tensor in stream),
        "push_views_of_fused": all(tensor._base is not None for name, tensor in stream if name in experts),
        "engine_params_checked": sorted(stacked_digests(dict(stream), lambda tensor: list(tensor.shape)).items()),
        "engine": {
            "quantization": quantization,
            "gpu_memory_utilization": utilization,
            "enable_sleep_mode": True,
            "max_model_len": 1024,
        },
        "optimizer": optimizer_impl,
        "floor": "push bytes / the D2D copy rate measured in the same run (benchmarks/limits.py)",
        "checkpoint": None,
    }
    if device != "meta":
        with tempfile.TemporaryDirectory(prefix="rk-colocated-plan-") as scratch:
            checkpoint = checkpoint_of(model, f"{key}-{layers}l", checkpoint_in or scratch)
            saved = saved_weights(checkpoint)
            plan["checkpoint"] = checkpoint if checkpoint_in else "(temporary)"
            plan["checkpoint_tensors"] = len(saved)
            plan["checkpoint_names_equal"] = sorted(saved) == sorted(name for name, _ in stream)
            plan["checkpoint_values_equal"] = plan["checkpoint_names_equal"] and all(
                tensor.dtype == saved[name].dtype and torch.equal(tensor, saved[name]) for name, tensor in stream
            )
            plan["checkpoint_config"] = {
                field: json.loads((Path(checkpoint) / "config.json").read_text()).get(field) for field in SHAPE_FIELDS
            }
    print(
        f"[{key}] plan: {layers} layers, {params / 1e6:.1f} M params ({plan['weight_bytes'] / 1e9:.2f} GB bf16); "
        f"pushes {plan['push_tensors']} tensors ({plan['push_expert_tensors']} per-expert views), "
        f"{plan['push_bytes'] / 1e9:.2f} GB; the engine's {len(plan['engine_params_checked'])} parameters checked; "
        f"vLLM quantization={quantization}, gpu_memory_utilization={utilization:g}; AdamW {optimizer_impl}; "
        f"checkpoint {plan['checkpoint']}"
        + (
            f" ({plan['checkpoint_tensors']} tensors, equal to the stream: {plan['checkpoint_values_equal']})"
            if device != "meta"
            else ""
        ),
        flush=True,
    )
    return plan


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="0.6b,8b")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--bucket-gib", type=float, default=2.0)
    parser.add_argument("--sleep-level", type=int, default=2, choices=(1, 2))
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--sha256", action="store_true", help="also compare full sha256 digests on the last step")
    parser.add_argument(
        "--no-overlap",
        action="store_true",
        help="copy the optimizer state after the sync, not during it (the sync phase then times the sync alone)",
    )
    parser.add_argument("--cuda-graphs", action="store_true", help="let vLLM capture CUDA graphs (slower start)")
    parser.add_argument(
        "--pushes",
        type=int,
        default=0,
        help="after the steps, this many syncs alone into the serving engine (trainer state resident)",
    )
    parser.add_argument(
        "--profile", help="cProfile the last of --pushes on both sides; text reports into this directory"
    )
    parser.add_argument(
        "--pin-cpus",
        action="store_true",
        help="keep the sender's thread and the vLLM worker's on different physical cores (less run-to-run drift)",
    )
    parser.add_argument(
        "--optimizer",
        choices=("foreach", "fused"),
        help="AdamW's implementation (default: foreach for the dense models, fused for the MoE ones, whose "
        "foreach temporaries would not fit)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        help="the MoE models' layer count (default: 30b-a3b as many of its 48 as fit an 80 GB H100 with AdamW "
        "beside vLLM at --gpu-memory-utilization, printed with its arithmetic; 30b-a3b-tiny 2)",
    )
    parser.add_argument(
        "--quantization",
        choices=("none", "fp8"),
        default="none",
        help="the engine's: fp8 serves the bf16 checkpoint quantized on load, and re-quantizes every sync",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="MoE models only, no GPU: build the model (30b-a3b on the meta device), write the checkpoint, check "
        "the trainer's stream against it and print the plan",
    )
    parser.add_argument(
        "--zero-grads",
        action="store_true",
        help="FSDPAdapter(zero_grads=True): the resume gives zero grads (in shared segments) that the step accumulates into",
    )
    parser.add_argument(
        "--path",
        choices=("direct", "bucket"),
        default="direct",
        help="the sender's path: direct (the default: the engine reads the trainer's weights where they lie) "
        "or bucket (direct=False: every weight packed into the bucket first)",
    )
    parser.add_argument(
        "--push-paths", help="the paths of the --pushes, alternating (e.g. bucket,direct; default: --path)"
    )
    parser.add_argument(
        "--trace",
        help="profile the last step's refit (CUDA activity) into this directory and print where "
        "the trainer's D2H copies ran against the phases; that step is left out of the medians",
    )
    parser.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="keep each model's checkpoint in DIR/qwen3-<model> (a MoE model's in DIR/qwen3-<model>-<layers>l): "
        "written on the first run, reused after (default: a fresh temporary directory every run)",
    )
    parser.add_argument("--json", help="write the results here (rewritten after each model)")
    args = parser.parse_args(argv)
    import refitkit

    if args.push_paths and not set(args.push_paths.split(",")) <= {"direct", "bucket"}:
        parser.error(f"--push-paths {args.push_paths!r}: a comma list of direct and bucket")
    keys = args.models.split(",")
    unknown = [key for key in keys if key not in MODELS and key not in MOE_MODELS]
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {sorted(MODELS) + sorted(MOE_MODELS)}")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers {args.layers}: need at least 1")
    quantization = None if args.quantization == "none" else args.quantization
    bucket_bytes = int(args.bucket_gib * (1 << 30))

    def optimizer_of(key: str) -> str:
        return args.optimizer or ("fused" if key in MOE_MODELS else "foreach")

    if args.dry_run:
        dense = [key for key in keys if key not in MOE_MODELS]
        if dense:
            parser.error(f"--dry-run plans the MoE models only, not {dense}")
        plans = [
            plan_moe(
                key,
                layers=args.layers,
                utilization=args.gpu_memory_utilization,
                bucket_bytes=bucket_bytes,
                quantization=quantization,
                optimizer_impl=optimizer_of(key),
                checkpoint_in=args.checkpoint,
            )
            for key in keys
        ]
        if args.json:
            Path(args.json).write_text(json.dumps(plans, indent=1))
        return plans
    if args.profile:  # collective_rpc of a function (the profiler's start and stop) needs vLLM's pickle path
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") != "spawn":
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # this process uses CUDA before vLLM starts
    results = []
    for key in keys:
        result = bench_model(
            key,
            steps=args.steps,
            bucket_bytes=bucket_bytes,
            sleep_level=args.sleep_level,
            utilization=args.gpu_memory_utilization,
            sha256=args.sha256,
            eager=not args.cuda_graphs,
            overlap=not args.no_overlap,
            pushes=args.pushes,
            optimizer_impl=optimizer_of(key),
            zero_grads=args.zero_grads,
            direct=args.path == "direct",
            push_paths=(args.push_paths or args.path).split(","),
            profile=args.profile,
            trace=args.trace,
            checkpoint_in=args.checkpoint,
            layers=args.layers if key in MOE_MODELS else None,
            quantization=quantization,
            pin_cpus=args.pin_cpus,
        )
        result["refitkit"] = str(Path(refitkit.__file__).resolve().parent)  # which refitkit ran (an A/B has two)
        print_summary(result)
        results.append(result)
        torch.cuda.empty_cache()
        if args.json:  # after each model: a run that dies in the next keeps this one's figures
            Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
