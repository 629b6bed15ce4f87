# specslot: `make serve` runs the service on the bundled model, `make test` runs the tests.
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

.PHONY: install serve test test-fast docs bench-quick bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/python -m serve_app.cli configs/local.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "not serve"

# docs/configuration.md's key tables, from the configs that declare each key
docs: $(STAMP)
	$(BIN)/python -m serve_app.config_docs

bench-quick: $(STAMP)
	$(BIN)/python -m scripts.bench_all --quick --out results/quick

bench: $(STAMP)
	$(BIN)/python -m scripts.bench_all --out results/full

clean:
	rm -rf $(VENV) results .pytest_cache
