"""TEST-ONLY: let megatron-core's DDP, distributed optimizer and GPT forward run on a CPU-only machine.

megatron-core hard-codes CUDA in places that have nothing to do with what refitkit tests
(``torch.cuda.current_device()`` as an allocation device, ``device="cuda"`` scalars,
``param.type() == "torch.cuda.BFloat16Tensor"`` checks, the CUDA RNG tracker, streams).
``install()`` routes those to the CPU for the life of the process. It does nothing when CUDA is
available, so the same tests run unshimmed on the GPU machine. Never import this from refitkit/.

Checked against megatron-core 0.16.1 (the newest wheel for Python 3.11).
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_INSTALLED = False


def _cpu_device(device: object) -> object:
    """Map any CUDA device spelling to the CPU; leave everything else alone."""
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrite ``device="cuda"`` in factory calls and make ``.cuda()`` / ``.to("cuda")`` stay on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _cpu_device(args[1]) is not args[1]:
            args = (args[0], torch.device("cpu"), *args[2:])
        if func is torch.Tensor.pin_memory:
            return args[0]
        return func(*args, **kwargs)


def _cpu_type(original):
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        # the distributed optimizer sorts params by 'torch.cuda.<T>Tensor' names
        if dtype is None and not kwargs and self.device.type == "cpu":
            name = original(self)  # may already be rewritten: the function mode re-enters here
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    return type_


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream`` on CPU: work is already ordered."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass


def install() -> bool:
    """Route megatron-core's CUDA assumptions to the CPU; returns whether the shim is active."""
    global _INSTALLED
    if torch.cuda.is_available():
        return False
    if _INSTALLED:
        return True
    from megatron.core.tensor_parallel import random as mcore_random

    torch.Tensor.type = _cpu_type(torch.Tensor.type)
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.Stream = _CpuStream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.default_stream = lambda device=None: _CpuStream()
    torch.cuda.current_stream = lambda device=None: _CpuStream()
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.manual_seed = torch.manual_seed
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    _CudaToCpuMode().__enter__()  # process-wide: a spawned test rank lives only for one world
    _INSTALLED = True
    return True


def _grouped_matmul(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """What ``grouped_gemm.ops.gmm`` computes: row block i of ``a`` (``batch_sizes[i]`` rows) times ``b[i]``."""
    blocks = a.split([int(n) for n in batch_sizes.tolist()], dim=0)
    return torch.cat([block @ (b[i].t() if trans_b else b[i]) for i, block in enumerate(blocks)], dim=0)


def install_grouped_gemm() -> bool:
    """On a CPU-only machine, stand in for the CUDA-only ``grouped_gemm`` package that ``GroupedMLP`` calls.

    megatron-core's ``GroupedMLP`` checks ``grouped_gemm_util.grouped_gemm`` at construction and runs
    ``grouped_gemm_util.ops.gmm`` in its forward; this gives it a plain-torch grouped matmul with the same
    arguments, and turns off its ``torch.compile`` of the GLU (CPU inductor would compile C++ in each rank).
    Everything else is megatron-core's own ``GroupedMLP``. Does nothing when CUDA is available: the GPU
    runs the real package. Checked against megatron-core 0.16.1.
    """
    if torch.cuda.is_available():
        return False
    import types

    from megatron.core.transformer.moe import experts, grouped_gemm_util

    if grouped_gemm_util.grouped_gemm is None:
        ops = types.SimpleNamespace(gmm=_grouped_matmul)
        grouped_gemm_util.grouped_gemm = types.SimpleNamespace(ops=ops)
        grouped_gemm_util.ops = ops
    experts.jit_fuser = lambda function: function
    return True
