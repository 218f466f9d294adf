#!/usr/bin/env bash
# `make test`: the suite in .venv, then the real-engine tests (tests/vllm) in .venv-vllm, which this
# script creates when missing (scripts/setup-vllm-env.sh, cached like .venv). Where that environment
# cannot be made, the real-engine tests are skipped and the reason is printed.
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTEST_ARGS=${PYTEST_ARGS:--n 2}
status=0
if scripts/setup-vllm-env.sh > .venv-vllm.log 2>&1 && [ -x .venv-vllm/bin/python ]; then
  vllm_ready=1
else
  vllm_ready=0
fi
# shellcheck disable=SC2086
"$VENV/bin/python" -m pytest $PYTEST_ARGS || status=$?
if [ "$vllm_ready" = 1 ]; then
  # shellcheck disable=SC2086
  # loadgroup: the tests that share one user-started server (xdist_group) run in one worker
  # heavy: the scenarios `make bench` runs (`make test-heavy`), the lighter cells covering their paths
  .venv-vllm/bin/python -m pytest $PYTEST_ARGS --dist loadgroup --durations=15 -m "not heavy" tests/vllm || status=$?
else
  echo "SKIPPED tests/vllm (real vLLM engine): the vLLM environment could not be made: $(grep -v '^\s*$' .venv-vllm.log | tail -1) (full log: .venv-vllm.log)"
fi
exit $status
