"""The prepared GPU check (tests/gpu/device_check.py) in its dry run on this CPU: every phase runs
at tiny shapes and the one JSON file says what each found."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu" / "device_check.py"


def _run(tmp_path: Path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "device_check.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), *args], env=env,
                          capture_output=True, text=True, timeout=900)
    assert out.is_file(), proc.stderr[-3000:]
    return proc.returncode, json.loads(out.read_text())


@pytest.mark.slow
def test_the_dry_run_runs_every_phase_and_writes_what_each_found(tmp_path):
    rc, data = _run(tmp_path)
    phases = data["phases"]
    assert rc == 0, json.dumps(phases, indent=1)[-3000:]
    assert list(phases) == ["bounds", "codecs", "refit", "ipc", "fused", "gdn"]
    assert data["dry_run"] and data["missing"] == [] and phases["bounds"]["d2d_copy_gbps"] > 0
    codecs = phases["codecs"]
    assert set(codecs["bytes"]) == {f"{f} eager" for f in ("FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4")}
    assert all(cell["equal"] for cell in codecs["bytes"].values()) and "compiled" in codecs  # says it did not compile
    assert all(codecs["throughput"][f]["share_of_d2d"] > 0 for f in ("FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4"))
    for preset in ("BF16", "FP8_BLOCK", "MXFP8", "NVFP4"):
        cell = phases["refit"][preset]
        assert cell["outcome"] == "live" and cell["storage_kept"] and cell["first_layers_equal_host_export"], cell
        assert cell["tensors_compared"] > 0 and cell["share_of_d2d"] > 0
    assert phases["ipc"]["digests_equal"] and phases["ipc"]["transport"].startswith("shm")
    for cell in phases["fused"]["tokens"].values():
        assert cell["logprob_max_abs_err"] < 1e-2 and cell["grad_weight_rel_err"] < 2e-2
    assert "skipped" in phases["gdn"]


def test_phases_past_the_budget_are_recorded_as_skipped(tmp_path):
    rc, data = _run(tmp_path, "--phases", "bounds,fused", "--budget-s", "0")
    assert rc == 0
    assert all("time budget" in data["phases"][p]["skipped"] for p in ("bounds", "fused"))
