"""Shared fixtures: CUDA gating for tests marked ``cuda``."""

from __future__ import annotations

import pytest
import torch

# `make test` runs the core suite under `python -O` (the library must not rely on assert): pytest still
# rewrites asserts in test modules, and this extends that to the helpers they import (harness, peers, ...).
pytest.register_assert_rewrite(
    "tests.helpers", "tests.transfer", "tests.refit", "tests.offload", "tests.engines", "tests.watchdog"
)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (marker `cuda`): run on the GPU machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
