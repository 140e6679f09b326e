# Set-up is idempotent: the venv is built once and reused until pyproject.toml or requirements.lock change.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.gemline-installed

.PHONY: setup setup-browser demo lint test bench clean-lake

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first: the CPU wheel of 2.13.0 (any other request pulls a CUDA build).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q fbgemm-gpu-cpu==1.8.0
	# torchrec declares the CUDA fbgemm-gpu: install it without deps, then its own needs from the lock.
	$(BIN)/pip install -q --no-deps torchrec==1.8.0
	$(BIN)/pip install -q -r requirements.lock
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

demo: setup
	$(BIN)/gemline demo $(ARGS)

# Headless Chromium for the report screenshot test (tests/validation/test_gate_end_to_end.py).
# CI runs as root on Debian; a machine that already has /usr/bin/chromium does nothing.
setup-browser:
	@test -x /usr/bin/chromium || { apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# ruff (lint, import order) and mypy on the packages; both read their settings from pyproject.toml.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy

# The tests run on every core (pytest-xdist), each test file on one worker so its module fixtures are built once;
# XDIST= runs them in this one process.
XDIST ?= -n auto --dist loadfile

test: setup setup-browser lint
	$(BIN)/python -m pytest -q $(XDIST) $(PYTEST_ARGS)

bench: setup
	$(BIN)/python -m benchmarks.kernels
