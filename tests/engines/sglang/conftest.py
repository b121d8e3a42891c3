"""The SGLang suite: GPU only (SGLang has no CPU build); collected only where ``sglang`` imports."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest

os.environ.setdefault("REFITKIT_SOCKET_DIR", tempfile.mkdtemp(prefix="rk-sock-"))  # before SGLang's processes start

if importlib.util.find_spec("sglang") is None:  # every environment but the GPU machine's sglang site
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def plugin_path(tmp_path_factory):
    from tests.engines.sglang.sglang_engine import install_entry_point

    directory = str(tmp_path_factory.mktemp("sglang-plugin"))
    install_entry_point(directory)
    return directory


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, plugin_path):
    """One engine on a tiny bf16 Llama with the memory saver on (weights released without a host backup)."""
    import torch

    from examples.tiny_llama import random_llama, save_checkpoint
    from tests.engines.sglang.sglang_engine import make_engine

    if not torch.cuda.is_available():
        pytest.skip("SGLang needs a CUDA GPU")
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    save_checkpoint(random_llama(seed=0).to(torch.bfloat16), path)
    engine = make_engine(path, enable_memory_saver=True)
    try:
        yield engine
    finally:
        engine.shutdown()
