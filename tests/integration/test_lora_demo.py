"""`refit demo lora [RANK] [--sync merged|adapter]` on the embedded model and engine."""

from __future__ import annotations

import json

import pytest

from app.cli.main import main
from tests.refit_support import one_thread  # noqa: F401  (autouse fixture)

BASE = ["demo", "--model", "micro-moe", "--steps", "2", "--json"]


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main([*BASE, *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_adapter_mode_sends_the_base_once_then_the_adapter_alone(capsys):
    out = _run(capsys, "lora", "4", "--sync", "adapter")
    steps = out["steps"]
    assert [(s["step"], s["arm"]) for s in steps][:2] == [(0, out["arms"][0]), (0, "BF16")]
    assert all(s["live"] and s["serving"] == "yes" for s in steps)
    assert all((s["base"] is not None) == (s["step"] == 0) for s in steps)
    later = [s for s in steps if s["step"] > 0]
    assert all(s["bytes_sent"] == out["adapter_bytes"] < out["model_bytes"] / 10 for s in later)
    assert all(s["probe"]["k3_kl"] == 0 for s in steps if s["arm"] == "BF16")  # the merged model, exactly
    assert [s["adapter_id"] for s in steps if s["arm"] == "BF16"] == [1, 2, 3]


def test_an_injected_base_fault_keeps_the_previous_adapter_and_the_next_step_recovers(capsys):
    out = _run(capsys, "lora", "4", "--sync", "adapter", "--inject-fault", "bucket:0", "--fault-step", "1")
    arm = [s for s in out["steps"] if s["arm"] == out["arms"][0]]
    assert [s["live"] for s in arm] == [True, False, True]
    failed = arm[1]
    assert failed["adapter_id"] == 1 and failed["serving"] == "yes"  # the previous adapter on the restored base
    assert "adapter 1 still serves" in failed["error"] and failed["base"]["outcome"] == "rolled-back"
    assert any("adapter update failed" in n for n in out["notes"])


def test_the_merged_mode_is_the_ordinary_demo_on_the_merged_model(capsys):
    merged = _run(capsys, "lora", "4")
    plain = _run(capsys)
    assert merged["settings"]["lora_rank"] == 4 and merged["settings"]["lora_sync"] == "merged"
    by_arm = {row["arm"]: row for row in merged["summary"]}
    assert by_arm["BF16"]["k3_kl"] == 0  # BF16 merged refits: exactly the trainer's merged model
    # the whole model every step, as many bytes as without an adapter
    assert by_arm["BF16"]["mb_per_refit"] == next(r for r in plain["summary"] if r["arm"] == "BF16")["mb_per_refit"]


@pytest.mark.parametrize(("args", "message"), [
    (["--lora-sync", "adapter"], "--lora-sync: goes with a LoRA adapter"),
    (["lora", "4", "--presets", "--engine", "vllm"], "--presets: is not an option of `refit demo lora --engine vllm`"),
    (["lora", "4", "--procs", "2"], "--procs: is not an option of `refit demo lora`"),
    (["--lora", "0"], "argument --lora: expected a whole number from 1 to 512"),  # the previous spelling
    (["lora", "0"], "argument RANK: expected a whole number from 1 to 512"),
])
def test_lora_options_that_do_not_go_together_are_refused_by_name(capsys, args, message):
    assert main(["demo", *args]) == 2
    assert message in capsys.readouterr().err
