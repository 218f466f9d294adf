"""MismatchSentinel: armed by the exporter's rule (rollout.quantization linear, moe or config_file
set, or a native quantization_config in the model's config.json at top level or under
text_config), off otherwise; it names what is active and flags a k3 KL above its threshold."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from app.bootstrap import bootstrap
from domain.errors import ConfigError
from domain.mismatch_sentinel import DEFAULT_K3_THRESHOLD, MismatchSentinel


def _model(tmp_path: Path, config: dict[str, object]) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("overrides", [
    [],  # the default structured config
    ["rollout.quantization.linear=BF16", "rollout.quantization.moe=BF16"],
    ["model.path=/no/such/model/dir"],
    ["model.path=Qwen/Qwen3-0.6B"],  # a remote hub id: not a local directory, nothing to read
], ids=["default", "bf16", "missing-path", "remote"])
def test_off(overrides: list[str]) -> None:
    sentinel = bootstrap(overrides=overrides).mismatch_sentinel()
    assert not sentinel.armed and sentinel.active is None
    assert sentinel.observe(10.0, step=3) is None and sentinel.alarms == []
    assert sentinel.status == "mismatch sentinel off (BF16 rollout)"


def test_off_for_a_model_directory_without_a_quantization_config(tmp_path: Path) -> None:
    path = _model(tmp_path, {"model_type": "qwen3", "text_config": {"hidden_size": 8}})
    assert not bootstrap(overrides=[f"model.path={path}"]).mismatch_sentinel().armed


@pytest.mark.parametrize(("overrides", "active"), [
    (["rollout.quantization.linear=MXFP8"], "linear=MXFP8"),
    (["rollout.quantization.moe=MXFP4"], "moe=MXFP4"),
    (["rollout.quantization.linear=MXFP8", "rollout.quantization.moe=MXFP8"], "linear=MXFP8, moe=MXFP8"),
    (["rollout.quantization.config_file=quant.json"], "config_file=quant.json"),
], ids=["linear-only", "moe-only", "both", "config-file"])
def test_on_for_rollout_quantization(overrides: list[str], active: str) -> None:
    sentinel = bootstrap(overrides=overrides).mismatch_sentinel()
    assert sentinel.armed and sentinel.active == active
    assert sentinel.status == f"mismatch sentinel armed: {active}; k3_kl threshold {DEFAULT_K3_THRESHOLD:g}"


@pytest.mark.parametrize("where", ["top", "text_config"])
def test_on_for_a_native_config_at_either_place(tmp_path: Path, where: str) -> None:
    qc = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    config = {"model_type": "qwen3", "quantization_config": qc} if where == "top" else \
        {"model_type": "qwen3_vl", "text_config": {"quantization_config": qc}}
    sentinel = bootstrap(overrides=[f"model.path={_model(tmp_path, config)}"]).mismatch_sentinel()
    assert sentinel.armed and sentinel.active == "native fp8"


def test_explicit_settings_name_themselves_over_the_checkpoint(tmp_path: Path) -> None:
    path = _model(tmp_path, {"quantization_config": {"quant_method": "fp8"}})
    sentinel = bootstrap(overrides=[f"model.path={path}", "rollout.quantization.moe=NVFP4"]).mismatch_sentinel()
    assert sentinel.active == "moe=NVFP4"


def test_flags_a_spike_above_the_threshold_only() -> None:
    sentinel = bootstrap(overrides=["rollout.quantization.linear=MXFP8",
                                    "rollout.quantization.moe=MXFP8"]).mismatch_sentinel(threshold=0.01)
    assert sentinel.observe(0.00387, step=1) is None
    assert sentinel.observe(0.01, step=2) is None  # at the threshold: not above it
    alarm = sentinel.observe(0.06, step=3)
    assert alarm is not None and alarm.step == 3 and alarm.k3_kl == 0.06
    assert alarm.message == ("train-rollout mismatch spike at step 3: rollout_corr/k3_kl 0.06 > 0.01 with a quantized "
                             "rollout (linear=MXFP8, moe=MXFP8)")
    assert sentinel.observe(math.nan) is not None  # a NaN mismatch is a spike too
    assert len(sentinel.alarms) == 2


@pytest.mark.parametrize("threshold", [0.0, -1.0, math.inf, math.nan, True, "0.1"])
def test_a_bad_threshold_is_a_typed_error(threshold: object) -> None:
    with pytest.raises(ConfigError, match="threshold"):
        MismatchSentinel("linear=MXFP8", threshold)  # type: ignore[arg-type]
