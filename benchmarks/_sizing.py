"""How large each benchmark may run on this machine: the plan `refitkit bench` follows.

Each benchmark's peak memory is estimated from its shapes (bytes per parameter measured on the
CPU machine with some margin); a benchmark that does not fit at full size is scaled down
(layers, then vocabulary, or a smaller model) and one that does not fit at its smallest, or
needs a GPU that is not there, is skipped with the reason. Nothing here allocates.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.shapes import CONFIGS, QWEN3_0_6B, QWEN3_8B, total_bytes

GIB = 1 << 30
MIB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
HOST_SHARE = 0.8  # of available host memory: the page cache, other processes and allocator slack need the rest
GPU_SHARE = 0.9  # of free GPU memory


@dataclass(frozen=True)
class Machine:
    """What the benchmarks may use: host bytes, free bytes on GPU 0 (0 without CUDA)."""

    host_bytes: int
    gpu_bytes: int = 0

    @property
    def has_gpu(self) -> bool:
        return self.gpu_bytes > 0


@dataclass(frozen=True)
class BenchPlan:
    """One benchmark: the arguments it runs with and how it was sized, or why it is skipped."""

    script: str
    args: tuple[str, ...] = ()
    note: str = ""
    skip: str = ""  # non-empty: not run, and this says why

    @property
    def runs(self) -> bool:
        return not self.skip


def available_host_bytes() -> int:
    """Host memory available now (psutil), before HOST_SHARE is applied."""
    import psutil

    return int(psutil.virtual_memory().available)


def free_gpu_bytes(timeout_s: float = 120.0) -> int:
    """Free memory on GPU 0, read in a child process so this one never holds a CUDA context; 0 without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return 0
    code = "import json, torch; print(json.dumps(torch.cuda.mem_get_info(0)))"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, check=True
        )
        return int(json.loads(done.stdout.strip().splitlines()[-1])[0])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return 0  # a GPU that cannot be queried is treated as absent: GPU benchmarks are skipped, not crashed


def probe_machine(*, host_bytes: int | None = None, gpu_bytes: int | None = None) -> Machine:
    """This machine's budget; an explicit ``host_bytes`` / ``gpu_bytes`` replaces the measured share."""
    host = host_bytes if host_bytes is not None else int(available_host_bytes() * HOST_SHARE)
    gpu = gpu_bytes if gpu_bytes is not None else int(free_gpu_bytes() * GPU_SHARE)
    return Machine(host_bytes=host, gpu_bytes=gpu)


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.1f} GiB"


# fsdp_offload.py: Qwen3-0.6B decoder shapes, fp32 params + AdamW states, FSDP2 at world size 1
FSDP_FULL_LAYERS, FSDP_FULL_VOCAB, FSDP_MIN_VOCAB = 28, 151936, 1024
# peak bytes per parameter: on CPU the model, its arena copy and the flat memcpy pair all live in host
# memory (measured 49-55 B/param); on a GPU the host holds the arena and the flat pinned buffer
FSDP_CPU_BYTES_PER_PARAM, FSDP_CPU_BASE_BYTES = 64, 768 * MIB
FSDP_HOST_BYTES_PER_PARAM, FSDP_GPU_BYTES_PER_PARAM, CUDA_BASE_BYTES = 28, 32, 2 * GIB


def fsdp_offload_params(layers: int, vocab_size: int) -> int:
    """Parameters of benchmarks/fsdp_offload.py's model (Qwen3-0.6B's shapes, ``layers`` decoder layers)."""
    hidden, inter, heads, kv_heads, head_dim = 1024, 3072, 16, 8, 128
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter
    per_layer += 2 * head_dim + 2 * hidden  # q/k norms, two RMSNorms
    return vocab_size * hidden + layers * per_layer + hidden


def fsdp_offload_peak(layers: int, vocab_size: int, *, gpu: bool) -> tuple[int, int]:
    """(host bytes, GPU bytes) at the benchmark's peak."""
    params = fsdp_offload_params(layers, vocab_size)
    if not gpu:
        return FSDP_CPU_BASE_BYTES + FSDP_CPU_BYTES_PER_PARAM * params, 0
    return CUDA_BASE_BYTES + FSDP_HOST_BYTES_PER_PARAM * params, GIB + FSDP_GPU_BYTES_PER_PARAM * params


def plan_fsdp_offload(machine: Machine) -> BenchPlan:
    script, gpu = "fsdp_offload.py", machine.has_gpu
    device_args = () if gpu else ("--device", "cpu")

    def fits(layers: int, vocab: int) -> bool:
        host, device = fsdp_offload_peak(layers, vocab, gpu=gpu)
        return host <= machine.host_bytes and (not gpu or device <= machine.gpu_bytes)

    full_host, full_gpu = fsdp_offload_peak(FSDP_FULL_LAYERS, FSDP_FULL_VOCAB, gpu=gpu)
    need = f"full size needs ~{_gib(full_host)} host" + (f", ~{_gib(full_gpu)} GPU" if gpu else "")
    if fits(FSDP_FULL_LAYERS, FSDP_FULL_VOCAB):
        return BenchPlan(script, device_args, note=f"full size (Qwen3-0.6B shapes; {need})")
    layers = max((n for n in range(1, FSDP_FULL_LAYERS) if fits(n, FSDP_FULL_VOCAB)), default=0)
    vocab = FSDP_FULL_VOCAB
    if layers == 0:
        layers = 1
        vocab = max((v for v in range(FSDP_FULL_VOCAB // 1024 * 1024, 0, -1024) if fits(1, v)), default=0)
    if vocab < FSDP_MIN_VOCAB:
        smallest, _ = fsdp_offload_peak(1, FSDP_MIN_VOCAB, gpu=gpu)
        return BenchPlan(
            script,
            skip=f"even 1 layer with a {FSDP_MIN_VOCAB}-row vocabulary needs ~{_gib(smallest)}; "
            f"budget {_gib(machine.host_bytes)} host (raise --host-memory-gib if more is free)",
        )
    args = (*device_args, "--layers", str(layers), "--vocab-size", str(vocab))
    return BenchPlan(
        script,
        args,
        note=f"sized to the machine: {layers} of {FSDP_FULL_LAYERS} layers, vocabulary "
        f"{vocab} of {FSDP_FULL_VOCAB} ({need}; budget {_gib(machine.host_bytes)} host)",
    )


def plan_offload(machine: Machine) -> BenchPlan:
    """benchmarks/offload.py: bf16 weights on the GPU, the arena and a pageable copy on the host."""
    if not machine.has_gpu:
        return BenchPlan("offload.py", skip="needs a CUDA GPU")
    for config in (QWEN3_8B, QWEN3_0_6B, CONFIGS["tiny"]):
        nbytes = total_bytes(config)
        if CUDA_BASE_BYTES + 2 * nbytes <= machine.host_bytes and GIB + 2 * nbytes <= machine.gpu_bytes:
            note = "full size" if config is QWEN3_8B else f"sized to the machine: {config.name} instead of Qwen3-8B"
            return BenchPlan("offload.py", ("--model", config.name), note=note)
    return BenchPlan(
        "offload.py",
        skip=f"even the tiny model does not fit {_gib(machine.host_bytes)} host / {_gib(machine.gpu_bytes)} GPU",
    )


def plan_pinning(machine: Machine) -> BenchPlan:
    """benchmarks/pinning.py: one host buffer of ``--gib`` GiB at a time (4 at full size)."""
    if not machine.has_gpu:
        return BenchPlan("pinning.py", skip="needs a CUDA GPU")
    gib = min(4, (machine.host_bytes - CUDA_BASE_BYTES) // GIB)
    if gib < 1:
        return BenchPlan(
            "pinning.py", skip=f"needs ~{_gib(CUDA_BASE_BYTES + GIB)} host, budget {_gib(machine.host_bytes)}"
        )
    note = "full size" if gib == 4 else f"sized to the machine: {gib} GiB buffers instead of 4"
    return BenchPlan("pinning.py", ("--gib", str(gib)), note=note)


def plan_weight_sync(machine: Machine) -> BenchPlan:
    """benchmarks/weight_sync.py: sender and receiver copies of the weights on one GPU, plus the bucket."""
    if not machine.has_gpu:
        if machine.host_bytes < 2 * GIB:
            return BenchPlan(
                "weight_sync.py", skip=f"--cpu-overhead needs ~2.0 GiB host, budget {_gib(machine.host_bytes)}"
            )
        return BenchPlan(
            "weight_sync.py", ("--cpu-overhead",), note="no GPU: the per-tensor CPU cost only (--cpu-overhead)"
        )
    bucket_and_contexts = 5 * GIB  # a 2 GiB bucket, the 2 x 2 GiB D2D probe before it, two CUDA contexts
    for models in (("0.6b", "8b"), ("0.6b",)):
        need = bucket_and_contexts + 2 * max(total_bytes(QWEN3_8B if m == "8b" else QWEN3_0_6B) for m in models)
        if need <= machine.gpu_bytes and 2 * CUDA_BASE_BYTES <= machine.host_bytes:
            note = "full size" if len(models) == 2 else "sized to the machine: Qwen3-0.6B only"
            return BenchPlan("weight_sync.py", ("--models", ",".join(models)), note=note)
    return BenchPlan("weight_sync.py", skip=f"Qwen3-0.6B needs more than the {_gib(machine.gpu_bytes)} GPU budget")


def plan_sync_floor(machine: Machine) -> BenchPlan:
    """benchmarks/sync_floor.py: the same GPU memory as weight_sync.py (GPU only: its hand-offs are stream operations)."""
    if not machine.has_gpu:
        return BenchPlan("sync_floor.py", skip="needs a CUDA GPU")
    sync = plan_weight_sync(machine)
    return (
        BenchPlan("sync_floor.py", sync.args, note=sync.note)
        if sync.runs
        else BenchPlan("sync_floor.py", skip=sync.skip)
    )


MEGATRON_HIDDEN, MEGATRON_LAYERS, MEGATRON_VOCAB = 2048, 8, 32000


def plan_megatron_offload(machine: Machine) -> BenchPlan:
    """benchmarks/megatron_offload.py: a GPT through megatron-core's DDP and distributed Adam (GPU only)."""
    script = "megatron_offload.py"
    if not machine.has_gpu:
        return BenchPlan(script, skip="needs a CUDA GPU")
    if (
        importlib.util.find_spec("megatron") is None
        or not (ROOT / "tests" / "engines" / "megatron" / "tiny_gpt.py").is_file()
    ):
        return BenchPlan(
            script, skip="needs megatron-core (pip install refitkit[megatron]) and the source checkout's tests/"
        )
    for layers in range(MEGATRON_LAYERS, 0, -1):
        params = 2 * MEGATRON_VOCAB * MEGATRON_HIDDEN + layers * 12 * MEGATRON_HIDDEN**2
        if CUDA_BASE_BYTES + 24 * params <= machine.host_bytes and GIB + 32 * params <= machine.gpu_bytes:
            note = (
                "full size"
                if layers == MEGATRON_LAYERS
                else f"sized to the machine: {layers} of {MEGATRON_LAYERS} layers"
            )
            return BenchPlan(script, ("--num-layers", str(layers)), note=note)
    return BenchPlan(
        script, skip=f"1 layer does not fit {_gib(machine.host_bytes)} host / {_gib(machine.gpu_bytes)} GPU"
    )


# refit_cycle.py: bf16 params (P bytes), AdamW's two states, grads, the step's temporaries and the receiver's
# params on the GPU (5 P), plus a 2 GiB bucket and a 2 GiB flat-copy buffer; the arena (3 P) and the flat
# pinned buffer on the host. On CPU the tiny smoke run: two processes importing torch, a few MB of weights.
REFIT_CYCLE_CPU_BYTES = 2 * GIB
REFIT_CYCLE_MODELS = {"8b": QWEN3_8B, "0.6b": QWEN3_0_6B, "tiny": CONFIGS["tiny"]}


def refit_cycle_peak(models: tuple[str, ...]) -> tuple[int, int]:
    """(host bytes, GPU bytes) at refit_cycle.py's peak on a GPU: its largest model's."""
    weights = max(total_bytes(REFIT_CYCLE_MODELS[m]) for m in models)
    return CUDA_BASE_BYTES + 3 * weights + 2 * GIB + 256 * MIB, GIB + 5 * weights + 4 * GIB


def plan_refit_cycle(machine: Machine) -> BenchPlan:
    script = "refit_cycle.py"
    if not machine.has_gpu:
        if machine.host_bytes < REFIT_CYCLE_CPU_BYTES:
            return BenchPlan(
                script,
                skip=f"the CPU smoke run needs ~{_gib(REFIT_CYCLE_CPU_BYTES)} host, budget {_gib(machine.host_bytes)}",
            )
        return BenchPlan(
            script,
            ("--preset", "tiny", "--device", "cpu", "--rounds", "1"),
            note="no GPU: tiny shapes on CPU (a smoke run, not the table's figures)",
        )
    for models in (("8b", "0.6b"), ("0.6b",), ("tiny",)):
        host, gpu = refit_cycle_peak(models)
        if host <= machine.host_bytes and gpu <= machine.gpu_bytes:
            note = "full size" if len(models) == 2 else f"sized to the machine: {models[0]} shapes only"
            return BenchPlan(script, ("--models", ",".join(models)), note=note)
    return BenchPlan(
        script, skip=f"even tiny shapes do not fit {_gib(machine.host_bytes)} host / {_gib(machine.gpu_bytes)} GPU"
    )


PLANNERS: dict[str, Callable[[Machine], BenchPlan]] = {
    "fsdp_offload": plan_fsdp_offload,
    "megatron_offload": plan_megatron_offload,
    "offload": plan_offload,
    "pinning": plan_pinning,
    "refit_cycle": plan_refit_cycle,
    "sync_floor": plan_sync_floor,
    "weight_sync": plan_weight_sync,
}


def plan_benchmarks(machine: Machine, names: list[str] | None = None) -> list[BenchPlan]:
    """The plan for ``names`` (default: every benchmark), in name order."""
    return [PLANNERS[name](machine) for name in sorted(names if names is not None else PLANNERS)]
