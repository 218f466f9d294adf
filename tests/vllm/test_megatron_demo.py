"""`refit demo megatron --engine vllm --json`: a real Megatron-Core trainer, tensor parallel 2
over processes of its own, trains and refits the vLLM server its engine rank starts; the command
compares the server after every refit with a cold start of the unsharded model's export (the
trainer's own weights, gathered through Megatron's checkpoint metadata), bit for bit. The demo runs
in the project's `.venv` (Megatron-Core), the servers in this environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm), which `make test` creates")

from tests.vllm.test_real_engine import MAIN_PYTHON, ROOT


# heavy (make bench): make test runs the same receiving side from sharded trainer processes
# (test_procs_demo.py), and Megatron's shares against the single-process export (tests/distributed)
@pytest.mark.heavy
def test_a_megatron_trainer_refits_a_vllm_server_equal_to_a_cold_start_of_its_unsharded_export() -> None:
    if not MAIN_PYTHON.exists():
        pytest.skip(f"{MAIN_PYTHON} is missing: the trainer runs in the project's .venv (`make setup`)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(RL_REFIT_VLLM_PYTHON=sys.executable, VLLM_CPU_KVCACHE_SPACE="1")
    done = subprocess.run([str(MAIN_PYTHON), "-m", "app.cli.main", "demo", "megatron", "--engine", "vllm",
                           "--tp", "2", "--steps", "1", "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    if done.returncode and "No module named 'megatron'" in done.stderr:
        pytest.skip("megatron-core is not installed in the project's .venv (the `megatron` extra)")
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout)
    assert out["engine"] == "vllm" and out["every_refit_live"] and out["equals_cold_start"]
    assert out["world"] == {"layout": "tp=2 pp=1 ep=1", "trainer_ranks": 2, "engines": 1}
    rows = out["refits"]
    assert [r["step"] for r in rows] == [0, 1] and rows[1]["loss"] is not None
    for r in rows:
        assert r["outcome"] == "live" and not r["errors"] and r["equals_cold_start"] is True, r
        (engine,) = r["engines"]
        assert engine["logprobs_equal"] and engine["tokens_equal"] and engine["max_abs_logp_diff"] == 0.0
        assert engine["weights_equal"] is True and engine["differing_weights"] == []
