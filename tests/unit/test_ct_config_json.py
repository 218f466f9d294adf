"""The exported quantization_config is one canonical form: compressed-tensors parses it back to the
config it was built from, and nothing in it depends on the installed release (no version stamp,
no None fields, no calibration observers). tests/vllm compares whole exports across releases."""

from __future__ import annotations

import itertools
import json

import pytest

pytest.importorskip("compressed_tensors", reason="the config is built with compressed-tensors' objects")

import compressed_tensors
from compressed_tensors.quantization import QuantizationConfig

from adapters.compressed_tensors.quantization_config import compressed_tensors_config, to_config_json
from domain.quant.plan import QuantizationPlan

FORMATS = [None, "FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4"]
PLANS = [
    QuantizationPlan.from_presets(lin, moe)
    for lin, moe in itertools.product(FORMATS, FORMATS)
    if lin is not None or moe is not None
] + [
    QuantizationPlan.from_presets("FP8_BLOCK", "NVFP4", moe_activation="nvfp4_per_token"),
    QuantizationPlan.from_presets("FP8_BLOCK", "MXFP4", moe_activation="mxfp8"),
    QuantizationPlan.from_presets(None, "MXFP4", moe_activation="none"),
]


def _walk(value: object, path: str = ""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield f"{path}.{k}", k, v
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}[{i}]")


def _calibration_free(dump: dict) -> dict:
    return json.loads(json.dumps(dump), object_hook=lambda d: {k: v for k, v in d.items() if k not in ("observer", "observer_kwargs")})


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"{p.linear.name}-{p.moe.name}-{p.effective_moe_activation.value}")
def test_config_parses_back_to_the_same_configuration(plan: QuantizationPlan) -> None:
    qc = compressed_tensors_config(plan)
    back = QuantizationConfig.model_validate(to_config_json(qc))
    assert _calibration_free(back.model_dump(mode="json")) == _calibration_free(qc.model_dump(mode="json"))


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"{p.linear.name}-{p.moe.name}-{p.effective_moe_activation.value}")
def test_config_holds_nothing_release_specific(plan: QuantizationPlan) -> None:
    config = to_config_json(compressed_tensors_config(plan))
    assert "version" not in config
    assert compressed_tensors.__version__ not in json.dumps(config)
    found = [(path, key) for path, key, v in _walk(config) if v is None or key in ("observer", "observer_kwargs", "run_compressed", "moe_sparsity_config")]
    assert found == []
    assert config["quant_method"] == "compressed-tensors" and config["quantization_status"] == "compressed"
