# The two commands of the README: `make demo` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?= -n 2

.PHONY: setup demo test test-heavy lint typecheck bench bench-real docs clean
# where `make bench-real` writes its real-size checkpoint (random weights at Qwen3-0.6B's shapes, untied)
REAL_MODEL ?= /tmp/rl-refit-qwen3-0.75b-untied
# and Qwen3-0.6B as released (tied head): the memory rows at its shape
TIED_MODEL ?= /tmp/rl-refit-qwen3-0.6b

setup:
	@scripts/setup-env.sh

demo: setup
	$(VENV)/bin/refit demo

test: setup
	@VENV=$(VENV) PYTEST_ARGS="$(PYTEST_ARGS)" scripts/test.sh

# the real-engine scenarios `make test` leaves out (marked heavy: the colocated twins of the server cells, the
# cells vLLM's CPU build cannot start, more delta and merged-LoRA cells, tensor parallel, a quantized user server)
test-heavy: setup
	scripts/setup-vllm-env.sh > .venv-vllm.log 2>&1 || (tail -5 .venv-vllm.log; exit 1)
	.venv-vllm/bin/python -m pytest $(PYTEST_ARGS) --dist loadgroup -m heavy tests/vllm

lint: setup
	$(VENV)/bin/ruff check domain ports adapters app tests

typecheck: setup
	$(VENV)/bin/mypy

bench: setup
	$(VENV)/bin/refit bench all --quick
	$(MAKE) bench-real
	$(MAKE) test-heavy

# the real-size rows (docs/your-model.md): export and engine benches on a 0.75B checkpoint, BF16 in both shapes,
# FP8_BLOCK colocated; export and BF16 in both shapes on the tied 0.6B
bench-real: setup
	test -f $(REAL_MODEL)/config.json || $(PY) -m app.bench.fixtures qwen3-0.75b-untied $(REAL_MODEL)
	test -f $(TIED_MODEL)/config.json || $(PY) -m app.bench.fixtures qwen3-0.6b $(TIED_MODEL)
	$(VENV)/bin/refit bench export --model $(TIED_MODEL)
	.venv-vllm/bin/python -m app.cli.main bench engine --model $(TIED_MODEL) --preset BF16 --deployment colocated
	$(VENV)/bin/refit bench engine --model $(TIED_MODEL) --preset BF16 --deployment disaggregated
	$(VENV)/bin/refit bench export --model $(REAL_MODEL)
	.venv-vllm/bin/python -m app.cli.main bench engine --model $(REAL_MODEL) --preset BF16 --deployment colocated
	$(VENV)/bin/refit bench engine --model $(REAL_MODEL) --preset BF16 --deployment disaggregated
	.venv-vllm/bin/python -m app.cli.main bench engine --model $(REAL_MODEL) --preset FP8_BLOCK --deployment colocated

docs: setup
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) .venv-vllm .venv-vllm.log .pytest_cache .mypy_cache .ruff_cache site
