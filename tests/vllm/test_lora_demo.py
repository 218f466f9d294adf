"""`refit demo lora --engine vllm --json`: the adapter mode into the vLLM server the demo starts
(disaggregated), each adapter step equal to vLLM's own load of the same adapter from a directory
(its disk twin), bit for bit: log-probs and greedy tokens. The trainer runs in the project's
`.venv`, the server in this environment, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm), which `make test` creates")

from tests.vllm.test_real_engine import MAIN_PYTHON, ROOT


@pytest.mark.slow
def test_every_adapter_step_equals_vllms_own_load_of_it() -> None:
    if not MAIN_PYTHON.exists():
        pytest.skip(f"{MAIN_PYTHON} is missing: the trainer runs in the project's .venv (`make setup`)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(RL_REFIT_VLLM_PYTHON=sys.executable, VLLM_CPU_KVCACHE_SPACE="1")
    done = subprocess.run([str(MAIN_PYTHON), "-m", "app.cli.main", "demo", "lora", "8", "--engine", "vllm",
                           "--steps", "2", "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout)
    assert (out["deployment"], out["model"], out["rank"], out["ok"]) == ("disaggregated", "micro-dense", 8, True)
    steps = out["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert [s["base_sent"] for s in steps] == [True, False, False]  # the base once, then the adapter alone
    for s in steps:
        assert s["live"] and s["logprobs_equal"] and s["tokens_equal"] and s["max_abs_diff"] == 0.0, s
        assert s["moved"], f"step {s['step']}: the served log-probs did not move: the comparison saw no new adapter"
        assert s["bytes_sent"] <= 2 * s["adapter_bytes"]  # the adapter's budget
