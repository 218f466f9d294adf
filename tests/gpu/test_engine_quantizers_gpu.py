"""The prepared GPU check of the engine rule against vLLM's CUDA quantizers (check_engine_quantizers.py),
and its verdict on CPU."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
import torch

HERE = pathlib.Path(__file__).resolve().parent
SCRIPT = HERE / "check_engine_quantizers.py"


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("check_engine_quantizers", SCRIPT)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (vLLM's CUDA quantizers)")
def test_engine_rule_equals_vllms_cuda_quantizers(tmp_path: pathlib.Path) -> None:
    have_vllm = importlib.util.find_spec("vllm") is not None
    cmd = [sys.executable, str(SCRIPT), "--out", str(tmp_path), *(["--python", sys.executable] if have_vllm else [])]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=480)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and any(r["ran"] for r in summary["results"])


# --- CPU: the verdict -----------------------------------------------------------------------------


def test_verdict_passes_only_when_every_comparison_that_ran_matched() -> None:
    s = _script()
    equal = {"name": "a", "ran": True, "differ": 0, "elements": 10}
    skipped = {"name": "b", "ran": False, "reason": "needs SM100"}
    ok, lines = s.verdict([equal, skipped])
    assert ok and lines == ["ok      a: all 10 equal", "not run b: needs SM100"]
    assert not s.verdict([equal, {**equal, "name": "c", "differ": 3}])[0]
    ok, lines = s.verdict([equal, {"name": "d", "ran": True, "error": "RuntimeError: no kernel"}])
    assert not ok and "raised RuntimeError" in lines[1]
    assert not s.verdict([])[0]  # nothing compared is not a pass


def test_the_script_names_the_pinned_vllm() -> None:
    from adapters.vllm.profile import PINNED_VLLM

    assert _script().pinned_vllm() == PINNED_VLLM
