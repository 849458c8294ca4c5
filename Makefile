# Set-up and entry points. `make run` and `make test` work on a fresh machine with Python 3.11.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= The capital of France is

.PHONY: setup run test test-all lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch 2.13.0 CPU build (the wheel these machines install from local disk).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/kiln generate "$(PROMPT)" --max-tokens 32 --temperature 0

test: setup
	$(PY) -m pytest -q -m "not slow and not gpu" tests

# Lint and import order (config in pyproject.toml).
lint: setup
	$(VENV)/bin/ruff check .

# Issue-2 throughput check: Kiln against HF transformers on the default model, same run.
bench: setup
	$(VENV)/bin/kiln bench throughput --num-prompts 32 --input-len 128 --output-len 128 \
		--max-model-len 512 --enforce-eager --backend hf

test-all: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV)
