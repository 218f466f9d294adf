"""`refit demo` end to end through the CLI entry point (on the micro model, to stay fast)."""

from __future__ import annotations

import json

import pytest
import structlog
import torch

from app.cli.main import main

MICRO = ["--model", "micro-moe", "--steps", "1"]


@pytest.fixture(autouse=True)
def _restore_logging(monkeypatch):
    """The CLI configures structlog and torch threads for the process; undo both afterwards."""
    import app.logging

    threads = torch.get_num_threads()
    monkeypatch.setattr(app.logging, "_configured", False)
    yield
    structlog.reset_defaults()
    torch.set_num_threads(threads)


def _demo_json(capsys, *args: str) -> dict:
    assert main(["demo", "--json", *MICRO, *args]) == 0
    return json.loads(capsys.readouterr().out)


def _rows(payload: dict, arm: str) -> list[dict]:
    return [s for s in payload["steps"] if s["arm"] == arm]


def test_default_plan_against_bf16(capsys):
    out = _demo_json(capsys)
    assert out["arms"] == ["FP8_BLOCK/NVFP4", "BF16"]
    assert out["settings"]["plan"] == "linear=FP8_BLOCK moe=NVFP4"
    for s in out["steps"]:
        assert s["refit"]["outcome"] == "live" and s["refit"]["storage"]["ok"] and s["serving"] == "yes"
    assert all(s["mismatch"]["k3_kl"] == 0.0 and s["mismatch"]["mean_abs_logp_diff"] == 0.0 for s in _rows(out, "BF16"))
    assert all(s["mismatch"]["k3_kl"] > 0 for s in _rows(out, "FP8_BLOCK/NVFP4"))
    plan, bf16 = out["summary"]
    assert plan["mb_per_refit"] < bf16["mb_per_refit"] and plan["kv_scales_reset"] == 2
    assert any("bit-identical" in n for n in out["notes"])


def test_injected_fault_shows_the_transactional_guarantee(capsys):
    out = _demo_json(capsys, "--steps", "2", "--bucket-mb", "0.0625", "--inject-fault", "bucket:1")
    by_step = {s["step"]: s for s in _rows(out, "FP8_BLOCK/NVFP4")}
    assert by_step[1]["refit"]["outcome"] == "rolled-back" and by_step[1]["weights_unchanged"] is True
    assert by_step[1]["serving"] == "yes" and by_step[1]["refit"]["buckets"] == 1
    assert by_step[0]["refit"]["outcome"] == by_step[2]["refit"]["outcome"] == "live"
    assert all(s["refit"]["outcome"] == "live" for s in _rows(out, "BF16"))  # only the plan's arm fails


def test_a_fault_past_the_last_bucket_is_reported_as_never_fired(capsys):
    out = _demo_json(capsys, "--inject-fault", "bucket:99")
    assert all(s["refit"]["outcome"] == "live" for s in out["steps"])
    assert any("never fired" in n for n in out["notes"])


def test_injected_fault_in_per_layer_mode_goes_stale_then_recovers(capsys):
    out = _demo_json(capsys, "--steps", "2", "--commit-mode", "per-layer", "--inject-fault", "finalize")
    by_step = {s["step"]: s for s in _rows(out, "FP8_BLOCK/NVFP4")}
    assert by_step[1]["refit"]["outcome"] == "stale" and by_step[1]["weights_unchanged"] is False
    assert by_step[1]["serving"] == "no (stale)" and by_step[1]["mismatch"] is None
    assert by_step[2]["refit"]["outcome"] == "live" and by_step[2]["serving"] == "yes"


def test_table_output_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed")
    png = tmp_path / "mismatch.png"
    assert main(["demo", "--model", "micro-moe", "--steps", "1", "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "BF16 refits: k3 KL = 0" in text and "MXFP4" in text and "plot written" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--inject-fault", "explode"], "bucket:K"),
        (["--linear", "FP9"], "rollout.quantization.linear"),
        (["--inject-fault", "finalize", "--fault-step", "5"], "--fault-step"),
    ],
)
def test_bad_arguments_exit_2_with_a_typed_message(capsys, args, message):
    assert main(["demo", *MICRO, *args]) == 2
    assert message in capsys.readouterr().err
