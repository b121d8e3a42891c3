"""Automodel's ranks import its parallelizer and transformers' models, about 6 s of CPU a rank beyond torch: the
tests' fork server imports them once (``tests/helpers/procs.py``)."""

from __future__ import annotations

import importlib.util

from tests.helpers import procs

if importlib.util.find_spec("nemo_automodel") is not None:
    procs.preload(
        "transformers",
        "nemo_automodel.components.distributed.model_parallelizer",
        "nemo_automodel.components.distributed.mesh",
    )
