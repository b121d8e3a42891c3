"""Automodel's ranks import its parallelizer and transformers (6 s of CPU a rank): the fork server does, once."""

from __future__ import annotations

from tests.helpers import procs

procs.preload(
    "transformers",
    "nemo_automodel.components.distributed.model_parallelizer",
    "nemo_automodel.components.distributed.mesh",
)
