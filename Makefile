# One entry point for everything: `make test` works from a fresh clone.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test acceptance lint unit integration bench run clean proto

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# setup.py builds the syncer's C kernels (src/ddiloco/_kernels.c) in place: a change to either installs again.
$(STAMP): $(BIN)/python pyproject.toml setup.py src/ddiloco/_kernels.c
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[dev,hf,ray]"
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

test: lint
	$(BIN)/python -m pytest -q -m "not acceptance" --durations=25

acceptance: $(STAMP)
	$(BIN)/python -m pytest -q -m acceptance --durations=10

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

integration: $(STAMP)
	$(BIN)/python -m pytest -q tests/integration

run: $(STAMP)
	$(BIN)/ddiloco run $(RUN_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_core.py

proto: $(STAMP)
	cd src && ../$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. ddiloco/transport/wire.proto

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache src/ddiloco/_kernels*.so
