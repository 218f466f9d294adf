"""`refit demo procs 3 --engine vllm --json`: trainer ranks in processes of their own (tensor
parallel 2, the dense model: FP8_BLOCK's 128-column blocks of o_proj and down_proj span both
shares) refit the vLLM server the engine rank starts; the command compares every refit that went
live with a cold start of the single-process export, bit for bit, and a failed refit with the
last live one. The demo runs in the project's `.venv`, the servers in this environment, as a user
runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm), which `make test` creates")

from tests.vllm.test_real_engine import MAIN_PYTHON, ROOT


@pytest.mark.slow
def test_tensor_parallel_ranks_refit_a_vllm_server_equal_to_a_cold_start_and_a_failed_refit_keeps_it() -> None:
    if not MAIN_PYTHON.exists():
        pytest.skip(f"{MAIN_PYTHON} is missing: the trainer runs in the project's .venv (`make setup`)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(RL_REFIT_VLLM_PYTHON=sys.executable, VLLM_CPU_KVCACHE_SPACE="1")
    done = subprocess.run([str(MAIN_PYTHON), "-m", "app.cli.main", "demo", "procs", "3", "--engine", "vllm",
                           "--model", "micro-dense", "--steps", "1", "--bucket-mb", "0.0625",
                           "--inject-fault", "finalize", "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout)
    assert out["engine"] == "vllm" and out["engines_match_cold_starts"] is True and out["fault_fired"] is True
    assert out["world"] == {"layout": "tp=2 pp=1 ep=1", "engines": 1}
    records = {(r["step"], r["rank"]): r for r in out["records"]}
    assert sorted(records) == [(s, r) for s in (0, 1) for r in range(3)]
    first = records[(0, 2)]
    assert first["outcome"] == "live" and first["weights"] == "= cold start", first
    assert first["logprobs_equal"] and first["tokens_equal"] and first["max_abs_logp_diff"] == 0.0
    assert first["weights_equal"] is True and first["differing_weights"] == []
    failed = [records[(1, r)] for r in range(3)]
    assert {r["outcome"] for r in failed} == {"rolled-back"}
    assert len({r["error"] for r in failed}) == 1 and "rank 2 (engine) at finalize" in failed[0]["error"]
    assert records[(1, 2)]["weights"] == "kept step 0, bit-identical"  # its log-probs, tokens and digests
