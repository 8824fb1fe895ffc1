# The two commands of the README. Both work on a fresh machine with only Python:
# they create .venv, install the pinned CPU torch and this package, then run.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
TORCH  ?= torch==2.13.0

.PHONY: demo test test-all test-peers peers-fetch lint format bench ds-fixtures gpu-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check $(TORCH)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/zeroshard run --nproc 2 examples/train_gpt.py --deepspeed_config examples/ds_config_demo.json
	$(BIN)/zeroshard plot runs/demo

# the representative cut (CI), after the linters; test-all adds the tests marked slow
# (the long layout and launch matrices, and, when .venv-bench exists, loading
# checkpoints the real DeepSpeed makes there and then). Both run on TEST_WORKERS
# pytest-xdist workers (a file whose tests share a fixture stays on one worker, the
# longest files start first: tests/conftest.py); TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder
test: lint
	$(BIN)/python -m pytest tests $(XDIST) --durations=15

test-all: $(STAMP)
	$(BIN)/python -m pytest tests $(XDIST) -m 'slow or not slow' --durations=15

# The peers' own DeepSpeed suites on zeroshard (issue 30; outside `make test`): transformers
# 5.24's DeepSpeed trainer tests, accelerate 1.15's tests/deepspeed and 33 files of
# DeepSpeed 0.16.5's tests/unit/runtime, read from PEERS_DIR (prepared once by
# `make peers-fetch`; nothing is fetched here). Hub models, the GLUE MRPC data set and
# metric are stand-ins built from code (tests/peers/peers_hub.py, peers_data.py).
# PEERS=transformers picks suites; K=EXPR is pytest -k; each target has 900 s.
# Counts per suite and target go to stdout (recorded in benchmarks/RESULTS.md); well over
# an hour on 2 cores (DeepSpeed's test_zero.py alone: about half of it).
PEERS_DIR ?= /work/peers
PEERS ?=
test-peers: $(STAMP)
	PEERS_DIR=$(PEERS_DIR) PYTHONPATH=$(CURDIR) $(BIN)/python tests/peers/run_peers.py $(PEERS) $(if $(K),-k '$(K)')

peers-fetch:
	PYTHON=$(BIN)/python tests/peers/fetch_peers.sh $(PEERS_DIR)

# ruff, then mypy over zeroshard/, tests/ and benchmarks/ ([tool.mypy] in pyproject.toml;
# about 80 s cold on 2 cores, seconds with its .mypy_cache)
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# The whole training matrix at each system's defaults: zeroshard stages 0-3 with and
# without optimizer offload, DDP, ZeroRedundancyOptimizer, FSDP2, DeepSpeed stages 0-3,
# both shapes, 5 interleaved rounds (~2 h on 2 cores); rows go to benchmarks/RESULTS.md.
# DeepSpeed goes in its own venv so the project's stays free of it.
bench: $(STAMP) .venv-bench/.installed-stamp
	$(BIN)/python benchmarks/bench_train.py --shape both --rounds 5 --json runs/bench_train.json --png runs/bench_train.png

# The DeepSpeed checkpoints tests/test_deepspeed_checkpoints.py loads (tests/data/deepspeed:
# 2 ranks on CPU, a few minutes; the fixtures in git were made with DeepSpeed 0.19.8)
ds-fixtures: .venv-bench/.installed-stamp
	DS_ACCELERATOR=cpu .venv-bench/bin/python tests/data/deepspeed/make_checkpoints.py tests/data/deepspeed

.venv-bench/.installed-stamp: pyproject.toml
	test -x .venv-bench/bin/python || $(PYTHON) -m venv .venv-bench
	.venv-bench/bin/python -m pip install -q --disable-pip-version-check $(TORCH) deepspeed==0.19.8 numpy
	.venv-bench/bin/python -m pip install -q --disable-pip-version-check -e . --no-deps
	touch $@

# The CUDA path on one H100/H200 in under 8 minutes: tests/test_cuda.py, then the 1B GPT's
# training rows (torch, stages 0-3, CPU offload exact/delayed at gas 1 and 8) and batch-1
# decode (bf16, int8, int4: eager and CUDA graph; HF generate; against the HBM roof:
# benchmarks/_gpu_decode.py); one table, appended to benchmarks/RESULTS.md,
# and benchmarks/GPU_LAST_GREEN.json when all passed. Needs a CUDA build of torch in
# GPU_PYTHON; without a GPU it stops at once (exit 2). COMMIT names the checkout where
# git cannot (a copy without .git).
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
COMMIT ?= $(shell git rev-parse HEAD 2>/dev/null)
gpu-check:
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) benchmarks/gpu_check.py $(if $(COMMIT),--commit $(COMMIT)) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .venv-bench build *.egg-info .pytest_cache .ruff_cache
