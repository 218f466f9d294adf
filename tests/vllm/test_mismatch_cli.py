"""`refit mismatch --model DIR --engine vllm --json` on a tiny Qwen3 written by transformers: for
each preset, the transformers model's log-probs against a real vLLM engine's (the CPU build), one
engine at a time, under verl's metric names.

The command runs in a process of its own (vLLM owns its process's global state).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm), which `make test` creates")

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 1200
NAMES = ("rollout_corr/k3_kl", "rollout_corr/kl", "rollout_corr/rollout_is_mean", "training/rollout_logprobs_diff_mean")


@pytest.mark.slow
@pytest.mark.heavy  # make test runs the command on the embedded engine (tests/unit/test_mismatch_cli.py)
def test_verl_named_metrics_for_each_preset_on_vllm(tmp_path: Path) -> None:
    from adapters.hf.fixtures import write_fixture

    model = write_fixture("tiny-qwen3", tmp_path / "tiny-qwen3")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["RL_REFIT_VLLM_PYTHON"] = sys.executable  # the engine host runs in this environment
    done = subprocess.run([sys.executable, "-m", "app.cli.main", "mismatch", "--model", str(model), "--engine", "vllm",
                           "--preset", "BF16", "--preset", "FP8_BLOCK", "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-6000:]
    out = json.loads(done.stdout)
    assert (out["engine"], out["model"], out["ok"]) == ("vllm", str(model), True)
    rows = {r["label"]: r for r in out["presets"]}
    assert list(rows) == ["BF16", "FP8_BLOCK"]
    for row in rows.values():
        assert row["error"] is None and set(NAMES) <= set(row["metrics"])
        m = row["metrics"]
        assert m["rollout_corr/k3_kl"] >= 0 and m["training/rollout_logprobs_diff_mean"] >= 0
        assert 0.5 < m["rollout_corr/rollout_is_mean"] < 2.0
    # transformers' BF16 forward and vLLM's kernels round differently; FP8 weights add their own error
    assert rows["FP8_BLOCK"]["metrics"]["rollout_corr/k3_kl"] > rows["BF16"]["metrics"]["rollout_corr/k3_kl"]
    assert rows["BF16"]["sentinel"] == "mismatch sentinel off (BF16 rollout)"
    assert rows["FP8_BLOCK"]["sentinel"].startswith("mismatch sentinel armed: linear=FP8_BLOCK, moe=FP8_BLOCK")
