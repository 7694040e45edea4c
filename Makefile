# lort: `make demo` and `make test` each set up everything on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench bench-peers docs conformance install native clean

$(STAMP): pyproject.toml requirements-ci.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch 2.13.0 CPU build first: pip takes it from this machine's disk (see README).
	$(PY) -m pip install -r requirements-ci.txt
	$(PY) -m pip install -e '.[test]'
	touch $(STAMP)

install: native

# lort's C++ frozen-weight check, built for the torch installed (about a minute the first
# time); without a compiler lort checks in Python, and tests/backend/test_weight_check.py says so.
native: $(STAMP)
	$(PY) -m lort.runtime.build_native || echo "make: the C++ frozen-weight check is not built: lort checks frozen weights in Python"

demo: native
	$(PY) examples/demo.py

test: native
	$(PY) -m pytest -q tests

# The main benchmark suite (python -m benchmarks speed), then its charts; every suite:
# python -m benchmarks --list. Results: benchmarks/results/.
BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -e '.[bench]'
	touch $(BENCH_STAMP)

bench: native $(BENCH_STAMP)
	$(PY) -m benchmarks speed $(ARGS)
	$(PY) -m benchmarks charts

# The peers of the quantized suites: torchao, ORT GenAI and llama.cpp (llama-cpp-python
# builds from source: a C++ compiler and cmake, 16 minutes on 2 cores), then those
# suites (an hour and more on 2 cores). Results: benchmarks/results/quantized_decoding.md.
# In a virtual environment of their own: torchao, once installed, is imported by
# transformers and warns in every process (make demo, the tests' warning checks).
PEERS_VENV := .venv-peers
# llama-cpp-python 0.3.36's AMX kernels die of SIGILL on Xeons with AMX: its worker threads
# run tile instructions without a valid tile configuration (llama.cpp PR 26954, open). Without
# them ggml runs its AVX-512 VNNI (or AVX2) kernels; other CPUs build as before.
LLAMA_NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
PEERS_PY := $(PEERS_VENV)/bin/python
PEERS_STAMP := $(PEERS_VENV)/.installed
$(PEERS_STAMP): pyproject.toml requirements-ci.txt
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_PY) -m pip install --upgrade pip
	$(PEERS_PY) -m pip install -r requirements-ci.txt
	# GGML_NATIVE: llama.cpp for this CPU, less its AMX kernels (LLAMA_NO_AMX); --no-cache-dir:
	# pip's wheel cache ignores CMAKE_ARGS
	CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$(LLAMA_NO_AMX)' -DCMAKE_CXX_FLAGS='$(LLAMA_NO_AMX)'" \
		CMAKE_BUILD_PARALLEL_LEVEL=2 $(PEERS_PY) -m pip install --no-cache-dir -e '.[test,peers]'
	touch $(PEERS_STAMP)

bench-peers: $(PEERS_STAMP)
	$(PEERS_PY) -m lort.runtime.build_native || echo "make: the C++ frozen-weight check is not built: lort checks frozen weights in Python"
	$(PEERS_PY) -m benchmarks quantized-encoder
	$(PEERS_PY) -m benchmarks quantized-decoding $(ARGS)

# The documentation site (Sphinx, MyST Markdown), warnings as errors: docs/_build/html.
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(PY) -m sphinx -W --keep-going -n -b html docs docs/_build/html

# PyTorch's OpInfo suite through lort (every op, float32/float64/int64), in worker
# processes; writes benchmarks/results/conformance.md.
conformance: native
	$(PY) -m benchmarks conformance

clean:
	rm -rf $(VENV) $(PEERS_VENV) build *.egg-info src/*.egg-info docs/_build docs/_generated
