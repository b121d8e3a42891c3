#!/usr/bin/env bash
# The real nemo-automodel package, without its GPU/data dependency tree (see envs/automodel.txt).
# Run by the Makefile from the repo root with VENV=.venv-automodel.
set -euo pipefail
"${VENV:?VENV must name the venv}/bin/python" -m pip install -q --disable-pip-version-check \
    -c constraints.txt --no-deps nemo-automodel==0.7.0
# fail the build here, not in the tests, if the parallelizer path needs something we left out
"$VENV/bin/python" -c "import nemo_automodel.components.distributed.model_parallelizer, nemo_automodel.components.distributed.mesh"
