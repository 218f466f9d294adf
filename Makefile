# The two commands of the README: `make demo` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?= -n 2

.PHONY: setup demo test lint typecheck bench docs clean

setup:
	@scripts/setup-env.sh

demo: setup
	$(VENV)/bin/refit demo

test: setup
	@VENV=$(VENV) PYTEST_ARGS="$(PYTEST_ARGS)" scripts/test.sh

lint: setup
	$(VENV)/bin/ruff check domain ports adapters app tests

typecheck: setup
	$(VENV)/bin/mypy

bench: setup
	$(VENV)/bin/refit bench all --quick

docs: setup
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) .venv-vllm .venv-vllm.log .pytest_cache .mypy_cache .ruff_cache site
