# The only commands a newcomer needs. `make test` and `make demo` build .venv from nothing.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/python -m pip --disable-pip-version-check --quiet

.PHONY: install demo test test-gpu gpu-wheels lint format bench clean

install: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -r requirements.lock
	$(PIP) install --no-deps -e .
	touch $@

demo: $(STAMP)
	$(BIN)/tlm demo

# one worker a core, a file's tests together (tests/budget.py); plain `pytest` runs serially
test: $(STAMP)
	$(BIN)/python -m pytest -n auto --dist loadfile

# The CUDA tier (tests marked `cuda`), on a machine with a GPU and its own CUDA build of
# PyTorch (`GPU_PYTHON`), which .venv's CPU build must not replace: tlm runs from src/, and
# what the tier needs beyond such a machine's image comes from wheels/ (`make gpu-wheels`,
# run where the package registries are reachable) into .gpu-site/.
GPU_PYTHON ?= python3
GPU_SITE := .gpu-site
GPU_WHEELS := annotated-doc annotated-types datasketch fastapi gguf h11 llguidance phonenumbers \
	pydantic pydantic_core starlette typing-inspection uvicorn

test-gpu:
	if [ -d wheels ]; then $(GPU_PYTHON) -m pip install --quiet --disable-pip-version-check \
		--no-index --no-deps --upgrade --target $(GPU_SITE) wheels/*.whl; fi
	PYTHONPATH=src:$(GPU_SITE) $(GPU_PYTHON) -m pytest -m cuda

gpu-wheels: $(STAMP)
	rm -rf wheels && $(PIP) download --dest wheels --no-deps --only-binary=:all: \
		--python-version 3.12 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
		$$(for name in $(GPU_WHEELS); do grep -i "^$$name==" requirements.lock; done)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: $(STAMP)
	for script in bench/[!_]*.py; do $(BIN)/python $$script || exit 1; done

clean:
	rm -rf $(VENV) $(GPU_SITE) wheels build src/*.egg-info .pytest_cache
