"""TorchTitan's ranks import its model registries and parallel dims, about 8 s of CPU a rank beyond torch: the
tests' fork server imports them once (``tests/helpers/procs.py``)."""

from __future__ import annotations

import importlib.util

from tests.helpers import procs

if importlib.util.find_spec("torchtitan") is not None:
    procs.preload(
        "torchtitan.distributed",
        "torchtitan.models.llama3.config_registry",
        "torchtitan.models.qwen3.config_registry",
        "torchtitan.models.qwen3.state_dict_adapter",
    )
