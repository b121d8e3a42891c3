"""Megatron tests need megatron-core (the .venv-megatron env: `make test-megatron`); skip them without it."""

from __future__ import annotations

import importlib.util

from tests.helpers import procs

if importlib.util.find_spec("megatron") is None:
    collect_ignore_glob = ["test_*.py"]


procs.preload(  # each rank's import: about 5 s of CPU
    "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer", "megatron.core.distributed"
)


def pytest_configure(config):
    # megatron-core warns at import that TE/Apex are absent; the local layer spec needs neither
    config.addinivalue_line("filterwarnings", "ignore:.*Apex.*not installed:UserWarning")
    config.addinivalue_line("filterwarnings", "ignore:.*Apex is not installed:UserWarning")
