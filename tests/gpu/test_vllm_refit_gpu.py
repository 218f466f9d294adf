"""The prepared H200 check of the vLLM adapter (check_vllm_refit.py), and its pure parts on CPU."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
import torch

HERE = pathlib.Path(__file__).resolve().parent
SCRIPT = HERE / "check_vllm_refit.py"


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("check_vllm_refit", SCRIPT)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Hopper or newer for FP8_BLOCK)")
def test_vllm_fp8_block_refit_on_gpu(tmp_path: pathlib.Path) -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8_BLOCK kernels need SM90+")
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=480)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert json.loads((tmp_path / "summary.json").read_text())["ok"]


# --- CPU: the script's comparison and verdict, and its pinned inputs --------------------------------


def _run(logprobs, greedy, **extra):  # type: ignore[no-untyped-def]
    return {"logprobs": logprobs, "greedy": greedy, "stale_before_refit": True,
            "refits": [{"storage_changed": []}, {"storage_changed": []}], "k_scales": [1.0, 1.0], **extra}


def test_compare_measures_logprob_and_greedy_agreement() -> None:
    s = _script()
    ref = _run([[-1.0, -2.0]], [[1, 2, 3, 4]])
    close = _run([[-1.02, -2.04]], [[1, 2, 3, 9]])
    got = s.compare(ref, close, {"mean_abs_logp": 0.05, "max_abs_logp": 0.05, "greedy_agreement": 0.75})
    assert got["mean_abs_logp"] == pytest.approx(0.03) and got["max_abs_logp"] == pytest.approx(0.04)
    assert got["greedy_agreement"] == 0.75 and got["ok"]
    assert not s.compare(ref, close, {"mean_abs_logp": 0.01, "max_abs_logp": 1, "greedy_agreement": 0})["ok"]


def test_verdict_fails_on_rebound_storage_unreset_kv_scales_or_a_crashed_arm() -> None:
    s = _script()
    ref = _run([[-1.0, -2.0]], [[1, 2]])
    good = {"bf16": ref, "fp8": ref, "fp8-kv": ref}
    assert s.verdict(good)[0]
    rebound = _run([[-1.0, -2.0]], [[1, 2]], refits=[{"storage_changed": ["x"]}])
    assert not s.verdict({**good, "fp8": rebound})[0]
    assert not s.verdict({**good, "fp8-kv": _run([[-1.0, -2.0]], [[1, 2]], k_scales=[0.37])})[0]
    ok, lines = s.verdict({**good, "fp8": {"error": "OOM"}})
    assert not ok and any("FAILED to run: OOM" in line for line in lines)


def test_the_pinned_version_and_quantization_config_are_current() -> None:
    from adapters.vllm.profile import PINNED_VLLM

    s = _script()
    assert s.pinned_vllm() == PINNED_VLLM
    pytest.importorskip("compressed_tensors")
    from adapters.compressed_tensors.quantization_config import compressed_tensors_config, to_config_json
    from domain.quant.plan import QuantizationPlan

    built = to_config_json(compressed_tensors_config(QuantizationPlan.from_presets("FP8_BLOCK")))
    assert json.loads(s.QCONFIG.read_text()) == json.loads(json.dumps(built))
