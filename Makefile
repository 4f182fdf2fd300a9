# The two set-up commands of the README:
#   make run    the whole system locally (simulated workers, decision service, gateway)
#   make test   lint + type check + import contracts + real vLLM prepared + the whole test suite
# Both create .venv and install what they need; nothing is installed by hand. `make vllm` prepares
# real vLLM on this CPU in its own venv (cached under ~/.cache/ppd-router, keyed by versions).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: venv run test lint typecheck vllm unit proto clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/ppd-up $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

# The real-vLLM test tier needs its venv and model; a failed preparation fails the run.
vllm: $(STAMP)
	$(BIN)/ppd-vllm prepare

test: lint typecheck vllm
	$(BIN)/pytest $(PYTEST_ARGS)

proto: $(STAMP)
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
