# The two commands of the README. Both work on a fresh machine with only Python:
# they create .venv, install the pinned CPU torch and this package, then run.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
TORCH  ?= torch==2.13.0

.PHONY: demo test test-all lint format bench gpu-check clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check $(TORCH)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/zeroshard run --nproc 2 examples/train_gpt.py --deepspeed_config examples/ds_config_demo.json
	$(BIN)/zeroshard plot runs/demo

# the representative cut (CI; well under 15 minutes on 2 cores), after the linters;
# test-all adds the tests marked slow (the long layout and launch matrices)
test: lint
	$(BIN)/python -m pytest tests --durations=15

test-all: $(STAMP)
	$(BIN)/python -m pytest tests -m 'slow or not slow' --durations=15

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

.venv-bench/.installed-stamp: pyproject.toml
	test -x .venv-bench/bin/python || $(PYTHON) -m venv .venv-bench
	.venv-bench/bin/python -m pip install -q --disable-pip-version-check $(TORCH) deepspeed numpy
	.venv-bench/bin/python -m pip install -q --disable-pip-version-check -e . --no-deps
	touch $@

clean:
	rm -rf $(VENV) .venv-bench build *.egg-info .pytest_cache .ruff_cache
