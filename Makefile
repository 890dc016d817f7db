# On a fresh clone `make train` and `make test` are all anyone needs: both install first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# the servers the tests start (MLflow's tracking server), apart from the project's own packages
SERVERS := .venv-servers
SERVERS_STAMP := $(SERVERS)/.installed
ARGS   ?=
# 3 workers on CI's 2 cores: a third keeps the cores busy while a test waits (on a timeout, a
# server, a signal); tests of one xdist_group (a shared run) on one; the 20 slowest tests listed
PYTEST_ARGS ?= -n 3 --dist loadgroup --durations=20
LOGDIR ?= logs
PORT   ?= 6006
OUT    ?= docs/img
# Where torch and torchvision come from: PyPI by default (with CUDA's libraries on Linux, 4.1 GB
# of the 6 GB install); make install TORCH_INDEX=https://download.pytorch.org/whl/cpu for CPU-only
TORCH_INDEX ?=

.DEFAULT_GOAL := help
.PHONY: help install servers train plan check eval test test-fast lint format tensorboard screenshots bench rename clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "trainkit needs Python 3.10+; run make PYTHON=python3.X")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(if $(TORCH_INDEX),$(BIN)/python -m pip install --quiet -c constraints.txt --index-url $(TORCH_INDEX) torch torchvision)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev,loggers]"
	@touch $(STAMP)

install: $(STAMP)  ## create .venv with the pinned, tested set (CPU-only torch: TORCH_INDEX=<PyTorch's CPU index>)

$(SERVERS_STAMP): constraints.txt constraints-servers.txt
	$(PYTHON) -m venv $(SERVERS)
	grep -v -E '^(SQLAlchemy|alembic)==' constraints.txt > $(SERVERS)/constraints.txt
	$(SERVERS)/bin/python -m pip install --quiet -c $(SERVERS)/constraints.txt \
	  -c constraints-servers.txt mlflow
	@touch $(SERVERS_STAMP)

servers: $(SERVERS_STAMP)  ## the tracking server the tests start: MLflow, in .venv-servers

train: $(STAMP)  ## train: make train ARGS="strategy=ddp devices=2"
	$(BIN)/python train.py $(ARGS)

plan: $(STAMP)  ## the memory plan of a run, and which strategy fits: make plan ARGS="devices=2"
	$(BIN)/python train.py plan=true $(ARGS)

check: $(STAMP)  ## a verdict on the run under each strategy, in about a minute: make check ARGS="model=..."
	$(BIN)/python train.py check=true $(ARGS)

eval: $(STAMP)  ## evaluate a checkpoint: make eval ARGS="ckpt_path=..."
	$(BIN)/python eval.py $(ARGS)

test: $(STAMP) $(SERVERS_STAMP)  ## run the test suite
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)  ## the quick tier for the edit loop: tests/unit, in-process (no process of its own)
	$(BIN)/python -m pytest tests/unit -m "not slow" -n 2 -q --durations=10

lint: $(STAMP)  ## the pre-commit hooks on every file: ruff lint and format, whitespace, YAML, TOML
	$(BIN)/pre-commit run --all-files --show-diff-on-failure

format: $(STAMP)  ## ruff fix and format
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

tensorboard: $(STAMP)  ## serve the logs: make tensorboard LOGDIR=logs PORT=6006
	$(BIN)/tensorboard --logdir $(LOGDIR) --port $(PORT)

screenshots: $(STAMP)  ## TensorBoard pages as PNGs (headless Chromium): make screenshots LOGDIR=<run> [OUT=docs/img]
	$(BIN)/python -m trainkit.screenshots --logdir $(LOGDIR) --out $(OUT)

bench: $(STAMP)  ## strategy benchmark matrix (about 11 min on 2 cores), into docs/performance.md: make bench [ARGS="--workloads mlp"]
	$(BIN)/python -m trainkit.bench --docs docs/performance.md $(ARGS)

rename:  ## rename the project's package under src/ (never src/trainkit): make rename NAME=acme
	@test -n "$(NAME)" || { echo "make rename: give the new name, e.g. make rename NAME=acme" >&2; exit 2; }
	$(PYTHON) tools/rename.py $(NAME)

clean:  ## remove the virtualenv, caches and logs
	rm -rf $(VENV) $(SERVERS) .pytest_cache .ruff_cache src/*.egg-info logs outputs multirun
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
