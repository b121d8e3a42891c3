"""TorchTitan's ranks import its registries and parallel dims (8 s of CPU a rank): the fork server does, once."""

from __future__ import annotations

from tests.helpers import procs

procs.preload(
    "torchtitan.distributed",
    "torchtitan.models.llama3.config_registry",
    "torchtitan.models.qwen3.config_registry",
    "torchtitan.models.qwen3.state_dict_adapter",
)
