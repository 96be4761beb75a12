# The two commands of the README: `make repro` and `make test`. Every target bootstraps
# .venv itself when it is missing or stale (keyed on a hash of pyproject.toml and the lock).
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
HASH := $(shell cat pyproject.toml requirements.lock | sha256sum | cut -c1-16)
STAMP := $(VENV)/.installed-$(HASH)
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export DVC_NO_ANALYTICS := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_HOME := $(CURDIR)/.prefect
export DO_NOT_TRACK := 1
export DS_BUILD_OPS := 0

.PHONY: setup repro test bench ui clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c requirements.lock -e '.[dev]'
# DeepSpeed builds from an sdist whose setup imports torch: no build isolation (it would fetch a CUDA torch),
# no prebuilt ops (DS_BUILD_OPS=0, exported above); the version and its dependencies are pinned in the lock.
	$(BIN)/python -m pip install -q --no-build-isolation -c requirements.lock deepspeed
	@rm -f $(VENV)/.installed-*
	@touch $@

repro: $(STAMP)
	$(BIN)/mars params check
	$(BIN)/dvc repro

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15

bench: $(STAMP)
	$(BIN)/python -m pip install -q -c requirements.lock -e '.[bench]'  # TRL for bench_rl's side-by-side
	@set -e; shopt -s nullglob; for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b; done

ui: $(STAMP)
	$(BIN)/mars ui

clean-venv:
	rm -rf $(VENV)
