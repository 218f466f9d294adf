"""docs/architecture.md's walk of one refit into vLLM states the count a tracer measures on the
trainer's side of a real refit: one FP8_BLOCK refit into the vLLM server rl-refit starts
(disaggregated), traced in the project's `.venv` from the service's call to the live weights
(tests/walk.py). The server's processes are vLLM's: the walk names their files, untraced."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm), which `make test` creates")

from tests.vllm.test_real_engine import MAIN_PYTHON
from tests.walk import per_package, run, stated


@pytest.mark.slow
def test_the_vllm_walk_states_the_files_a_traced_refit_calls_on_the_trainers_side() -> None:
    if not MAIN_PYTHON.exists():
        pytest.skip(f"{MAIN_PYTHON} is missing: the trainer runs in the project's .venv (`make setup`)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(RL_REFIT_VLLM_PYTHON=sys.executable, VLLM_CPU_KVCACHE_SPACE="1")
    files = run(str(MAIN_PYTHON), ["--vllm-refit"], env=env)
    for name in ("adapters/vllm/attached.py", "adapters/vllm/controls.py", "adapters/vllm/engine.py",
                 "adapters/distributed/shm_transport.py", "domain/quant/codecs/fp8_block.py",
                 "app/services/transaction.py"):
        assert name in files, f"{name} is not on the traced walk: {sorted(files)}"
    total, packages = stated("tests/vllm/test_refit_walk.py")
    assert (len(files), per_package(files)) == (total, packages), (
        f"docs/architecture.md states {total} files {packages}; the tracer counts {len(files)} "
        f"{per_package(files)}: {sorted(files)}")
