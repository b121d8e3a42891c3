#!/usr/bin/env bash
# verl 0.9.1 itself, without its dependency tree (see envs/verl.txt for what is installed instead and why).
# Run by the Makefile from the repo root with VENV=.venv-verl.
set -euo pipefail
"${VENV:?VENV must name the venv}/bin/python" -m pip install -q --disable-pip-version-check \
    -c constraints.txt --no-deps verl==0.9.1
# fail the build here, not in the tests, if something verl's workers, registries or config import is missing
"$VENV/bin/python" -W ignore -c "import verl.checkpoint_engine, verl.workers.engine_workers, verl.workers.rollout.base, verl.workers.config, verl.trainer.main_ppo"
