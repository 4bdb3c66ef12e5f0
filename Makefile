# The only commands a newcomer needs. `make test` and `make demo` build .venv from nothing.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/python -m pip --disable-pip-version-check --quiet

.PHONY: install demo test lint format bench clean

install: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -r requirements.lock
	$(PIP) install --no-deps -e .
	touch $@

demo: $(STAMP)
	$(BIN)/tlm demo

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP)
	for script in bench/[!_]*.py; do $(BIN)/python $$script || exit 1; done

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
