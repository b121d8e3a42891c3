# Two commands on a fresh machine: `make demo` and `make test`. Each builds what it needs.
# The core venv (.venv) holds torch (pinned CPU wheel) and refitkit with its test extras.
# Engines whose pins conflict get their own venv, .venv-NAME, from envs/NAME.txt
# (+ optional envs/NAME.post.sh), and their tests live in tests/engines/NAME/.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# pip compiles the .pyc at install: keep it (no --no-compile). These machines set PYTHONDONTWRITEBYTECODE=1, so a
# module without one is compiled again by every process that imports it.
PIP_FLAGS := -q --disable-pip-version-check -c constraints.txt
# Suites that run in the core venv, and engines with a venv of their own (added as each lands).
CORE_TEST_DIRS := tests/offload tests/refit tests/rollout tests/watchdog tests/transfer tests/engines/fsdp tests/test_cli.py tests/test_procs.py tests/test_library_rules.py tests/test_bench_refit_cycle.py tests/test_bench_ab.py tests/test_bench_verl_timeline.py
ENGINE_ENVS := megatron torchtitan automodel vllm verl
PYTEST_FLAGS ?= -q -p no:cacheprovider

.PHONY: demo lint test test-core test-engines test-install test-gpu bench audit clean

$(VENV)/.installed: setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) --upgrade pip setuptools wheel
	$(PY) -m pip install $(PIP_FLAGS) torch==2.13.0
	$(PY) -m pip install $(PIP_FLAGS) -e '.[test,plot,lint]'
	touch $@

.venv-%/.installed: envs/%.txt setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv .venv-$*
	.venv-$*/bin/python -m pip install $(PIP_FLAGS) --upgrade pip setuptools wheel
	.venv-$*/bin/python -m pip install $(PIP_FLAGS) torch==2.13.0
	.venv-$*/bin/python -m pip install $(PIP_FLAGS) -e '.[test]'
	.venv-$*/bin/python -m pip install $(PIP_FLAGS) -r envs/$*.txt
	if [ -f envs/$*.post.sh ]; then VENV=.venv-$* bash envs/$*.post.sh; fi
	touch $@

demo: $(VENV)/.installed
	$(PY) -m refitkit.cli demo

# The core suite first, with no other suite beside it: its transfer tests hold peers to timed bounds, and on the
# 2-core CI box a vLLM suite beside it can starve them. The engines' venvs build meanwhile at the lowest CPU priority
# (nice 19), on what the suite leaves idle. Then the engines' suites and the install check two at a time (most of their
# time is child processes starting and waiting).
ENGINE_VENVS := $(foreach engine,$(ENGINE_ENVS),.venv-$(engine)/.installed)
test:
	$(MAKE) -j2 --output-sync=target lint-and-core engine-venvs
	$(MAKE) -j2 --output-sync=target test-engines test-install

.PHONY: lint-and-core engine-venvs
lint-and-core: $(VENV)/.installed
	$(MAKE) lint
	$(MAKE) test-core

engine-venvs:
	nice -n 19 $(MAKE) -j1 $(ENGINE_VENVS)

# One formatter and linter (ruff, configured in pyproject.toml) over the library, its tests, benchmarks and examples.
LINT_DIRS := refitkit tests benchmarks examples
lint: $(VENV)/.installed
	$(VENV)/bin/ruff format --check $(LINT_DIRS)
	$(VENV)/bin/ruff check $(LINT_DIRS)

# Under -O: the library's checks must not be asserts (they would vanish); pytest keeps the tests' own.
test-core: $(VENV)/.installed
	$(PY) -O -m pytest $(PYTEST_FLAGS) $(CORE_TEST_DIRS)

test-engines: $(addprefix test-,$(ENGINE_ENVS))

# What `pip install .` gives a user: the wheel (built from a copy: setuptools writes nothing beside the sources)
# in a fresh venv with torch first and then only its install_requires (no extras), exercised from a folder
# outside the checkout, so the checkout is not on the path: tests/install/smoke.py (two gloo ranks refit, a
# broadcast across two processes, `refitkit demo`, `refitkit --help`, `refitkit bench` outside a checkout).
INSTALL_DIR := build/install
test-install:
	rm -rf $(INSTALL_DIR) && mkdir -p $(INSTALL_DIR)/src
	cp -R setup.cfg pyproject.toml README.md refitkit $(INSTALL_DIR)/src/
	$(PYTHON) -m venv $(INSTALL_DIR)/venv
	$(INSTALL_DIR)/venv/bin/python -m pip install $(PIP_FLAGS) torch==2.13.0
	$(INSTALL_DIR)/venv/bin/python -m pip wheel $(PIP_FLAGS) --no-deps -w $(INSTALL_DIR)/wheel $(INSTALL_DIR)/src
	$(INSTALL_DIR)/venv/bin/python -m pip install $(PIP_FLAGS) $(INSTALL_DIR)/wheel/refitkit-*.whl
	outside=$$(mktemp -d) && cp tests/install/smoke.py $$outside/ && cd $$outside && \
	  env -u PYTHONPATH $(CURDIR)/$(INSTALL_DIR)/venv/bin/python smoke.py; status=$$?; rm -rf $$outside; exit $$status

# Core tests that need transformers 5 (the core venv has none, so they skip there): a transformers model streamed by
# FSDPAdapter, as Automodel's trainers hand it one; they run with the automodel suite, in its venv.
EXTRA_TESTS_automodel := tests/engines/fsdp/test_fsdp_transformers.py tests/rollout/test_moe_coverage.py tests/test_bench_colocated_loop.py

# one explicit rule per engine (make skips pattern rules for phony targets, so no `test-%`)
define ENGINE_TEST_RULE
.PHONY: test-$(1)
test-$(1): .venv-$(1)/.installed
	.venv-$(1)/bin/python -m pytest $$(PYTEST_FLAGS) tests/engines/$(1) $$(EXTRA_TESTS_$(1))
endef
$(foreach engine,$(ENGINE_ENVS),$(eval $(call ENGINE_TEST_RULE,$(engine))))

# On a GPU machine whose Python already has CUDA torch (and GPU vLLM, e.g. from a wheel kit): every GPU suite,
# each in its own pytest process; the cuda-marked tests of each suite, and the whole vLLM suite against GPU vLLM.
GPU_PYTHON ?= python3
GPU_SUITES := tests/offload tests/transfer tests/refit tests/watchdog tests/rollout tests/engines/fsdp \
	tests/engines/megatron tests/engines/torchtitan tests/engines/automodel
# SGLang's kit installs into its own site (its pins differ from vLLM's): bash .gpu-kit/sglang/install.sh sglang .gpu-kit/sglang $(SGLANG_SITE)
SGLANG_SITE ?= /tmp/ssite
test-gpu:
	@status=0; for suite in $(GPU_SUITES); do \
	  echo "== $$suite (-m cuda)"; $(GPU_PYTHON) -m pytest $(PYTEST_FLAGS) -m cuda $$suite; rc=$$?; \
	  [ $$rc = 0 ] || [ $$rc = 5 ] || status=1; done; \
	echo "== tests/engines/vllm (whole suite)"; \
	VLLM_WORKER_MULTIPROC_METHOD=spawn $(GPU_PYTHON) -m pytest $(PYTEST_FLAGS) tests/engines/vllm || status=1; \
	echo "== tests/engines/sglang (-m cuda, sglang site $(SGLANG_SITE))"; \
	PYTHONPATH=$(SGLANG_SITE):$(CURDIR) $(GPU_PYTHON) -m pytest $(PYTEST_FLAGS) -m cuda tests/engines/sglang; \
	rc=$$?; [ $$rc = 0 ] || [ $$rc = 5 ] || status=1; \
	exit $$status

bench: $(VENV)/.installed
	$(PY) -m refitkit.cli bench

audit: $(VENV)/.installed
	$(PY) -m refitkit.cli audit

clean:
	rm -rf $(VENV) .venv-* build *.egg-info
