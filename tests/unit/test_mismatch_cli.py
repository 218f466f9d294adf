"""`refit mismatch` on the embedded engine: per preset, verl-named metrics of the trainer's
log-probs against the rollout's, the sentinel's verdict, the plot; bad options on one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.cli.main import main

NAMES = ("rollout_corr/k3_kl", "rollout_corr/kl", "rollout_corr/rollout_is_mean", "training/rollout_logprobs_diff_mean",
         "rollout_corr/rollout_rs_masked_fraction", "training/rollout_probs_diff_max")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict]:  # type: ignore[type-arg]
    code = main(["mismatch", "--model", "micro-dense", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_every_preset_gets_verl_named_metrics_and_bf16_is_exact(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(capsys, "--preset", "BF16", "--preset", "MXFP8", "--preset", "FP8_BLOCK/BF16")
    assert code == 0 and out["ok"] and out["engine"] == "embedded" and out["model"] == "micro-dense"
    rows = {r["label"]: r for r in out["presets"]}
    assert list(rows) == ["BF16", "MXFP8", "FP8_BLOCK/BF16"]
    for row in rows.values():
        assert row["error"] is None and set(NAMES) <= set(row["metrics"])
    bf16 = rows["BF16"]["metrics"]
    assert bf16["rollout_corr/k3_kl"] == 0 and bf16["training/rollout_logprobs_diff_mean"] == 0
    assert bf16["rollout_corr/rollout_is_mean"] == pytest.approx(1.0)
    assert rows["BF16"]["sentinel"] == "mismatch sentinel off (BF16 rollout)"
    mx = rows["MXFP8"]["metrics"]
    assert mx["rollout_corr/k3_kl"] > 0 and mx["training/rollout_logprobs_diff_mean"] > 0
    assert rows["MXFP8"]["sentinel"].startswith("mismatch sentinel armed: linear=MXFP8, moe=MXFP8")
    assert rows["FP8_BLOCK/BF16"]["sentinel"].startswith("mismatch sentinel armed: linear=FP8_BLOCK;")
    assert rows["MXFP8"]["alarm"] is None  # far below the default threshold


def test_a_spike_above_the_kl_threshold_is_flagged(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(capsys, "--preset", "MXFP4", "--kl-threshold", "1e-9", "--rollout-rs", "none")
    row = out["presets"][0]
    assert code == 0 and row["alarm"].startswith("train-rollout mismatch spike: rollout_corr/k3_kl ")
    assert row["alarm"].endswith("> 1e-09 with a quantized rollout (linear=MXFP4, moe=MXFP4)")
    assert not any(k.startswith("rollout_corr/rollout_rs") for k in row["metrics"])


def test_the_table_and_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the plot extra)")
    plot = tmp_path / "mismatch.png"
    assert main(["mismatch", "--model", "micro-dense", "--preset", "BF16", "--preset", "NVFP4", "--plot", str(plot)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("refit mismatch: engine embedded, model micro-dense, ")
    assert "rollout_corr/k3_kl" in text and "NVFP4" in text and plot.stat().st_size > 0


@pytest.mark.parametrize(("argv", "line"), [
    (["--preset", "FP7"], "refit mismatch: ConfigError: --preset: 'FP7'"),
    (["--preset", "MXFP8/"], "refit mismatch: ConfigError: --preset: 'MXFP8/' is not NAME or LINEAR/MOE"),
    (["--colocated"], "refit mismatch: ConfigError: --colocated: goes with --engine vllm"),
    (["--engine", "vllm", "--colocated"], "refit mismatch: ConfigError: --colocated: scores one preset per run (3 asked)"),
    (["--rollout-is", "geometric"], "argument --rollout-is: expected one of token, sequence or none"),
    (["--kl-threshold", "0"], "argument --kl-threshold: expected a positive number"),
])
def test_bad_options_are_one_line(argv: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mismatch", "--model", "micro-dense", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and line in err, err
