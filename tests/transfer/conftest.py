"""Fixtures for transfer tests: a private socket dir, unique endpoints, one long-lived receiver process."""

from __future__ import annotations

import os
import tempfile
import uuid

import pytest
import torch

# Set before any receiver process is spawned, so children inherit it.
os.environ.setdefault("REFITKIT_SOCKET_DIR", tempfile.mkdtemp(prefix="rk-sock-"))

from tests.transfer.harness import CASES  # noqa: E402
from tests.transfer.peers import ReceiverServer  # noqa: E402


@pytest.fixture
def endpoint() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="session")
def receiver_server():
    server = ReceiverServer()
    yield server
    server.close()


@pytest.fixture(autouse=True)
def _device_cache_emptied():
    """Each test starts and ends with nothing cached by torch on the GPU, so no test (here or in another
    package run in the same process) measures device memory that an earlier test left behind."""
    _empty_device_cache()
    yield
    _empty_device_cache()


def _empty_device_cache() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@pytest.fixture(params=CASES)
def case(request):
    """Where tensors live and which transport carries them; CUDA cases run on the GPU machine only."""
    return request.param
