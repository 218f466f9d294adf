"""`refit plan` as a verl user meets it: both honoured environment variables checked through the
composition root, each role's backend decision, the engine it checked on the first line, and
YAML files with verl's dotted top-level keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.bootstrap import bootstrap
from app.cli.main import main
from app.config import load_config
from domain.errors import ConfigError, FusedForwardModeError, UnknownConfigKey


@pytest.mark.parametrize(("name", "value", "error"), [
    ("VERL_FUSED_USE_OP_HOOK", "bogus", FusedForwardModeError),
    ("VERL_ROLLOUT_USE_DEEP_GEMM", "maybe", ConfigError),
])
def test_bad_environment_values_are_refused_by_the_composition_root(name: str, value: str, error: type) -> None:
    services = bootstrap(overrides=["actor.fused_forward=hook"], environ={name: value})
    with pytest.raises(error, match=rf"^{name}: .*{value!r}"):
        services.check_environment()  # even where actor.fused_forward wins over the variable
    bootstrap(environ={"VERL_FUSED_USE_OP_HOOK": "legacy", "VERL_ROLLOUT_USE_DEEP_GEMM": "0"}).check_environment()


@pytest.mark.parametrize(("name", "value"), [("VERL_FUSED_USE_OP_HOOK", "bogus"),
                                             ("VERL_ROLLOUT_USE_DEEP_GEMM", "maybe")])
def test_plan_exits_2_on_one_line_naming_the_variable(name: str, value: str, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(name, value)
    assert main(["plan", "rollout.name=vllm", "--json"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["error"]["message"].startswith(f"{name}: ")
    assert len(err.splitlines()) == 1 and err.startswith("refit plan: ") and name in err


def test_plan_prints_each_roles_backend_decision(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("VERL_ROLLOUT_USE_DEEP_GEMM", raising=False)
    assert main(["plan", "rollout.name=vllm", "rollout.quantization.linear=FP8_BLOCK", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["checked"] == "engine vllm"
    assert set(out["backends"]) >= {"linear", "moe", "notes", "opted_out"}
    assert out["backends"]["linear"]["backend"] and out["backends"]["linear"]["reason"]
    assert out["backends"]["opted_out"] is False
    monkeypatch.setenv("VERL_ROLLOUT_USE_DEEP_GEMM", "0")
    assert main(["plan", "rollout.name=vllm", "rollout.quantization.linear=FP8_BLOCK", "--json"]) == 0
    opted = json.loads(capsys.readouterr().out)["backends"]
    assert opted["opted_out"] is True and opted["linear"]["backend"] == "auto"
    assert main(["plan", "rollout.name=vllm", "rollout.quantization.linear=FP8_BLOCK"]) == 0
    text = capsys.readouterr().out
    assert "backend decision (vllm)" in text and "DeepGEMM opt-out" in text


def test_the_embedded_engine_says_so_and_names_verls_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["engine"] == "reference" and out["backends"] is None
    assert out["checked"] == "the embedded engine (rollout.name=reference; verl's default is vllm: add rollout.name=vllm)"
    assert main(["plan"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].startswith("refit plan: checked the embedded engine (")
    assert "backends: reference computes in pure torch; no kernel to choose" in text


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "verl.yaml"
    path.write_text(text)
    return path


def test_dotted_top_level_keys_load_as_verl_writes_them(tmp_path: Path) -> None:
    dotted = load_config(_write(tmp_path, (
        "actor_rollout_ref.actor.megatron.override_transformer_config:\n  fp8: e4m3\n  fp8_recipe: blockwise\n"
        "actor_rollout_ref.rollout.name: vllm\nactor_rollout_ref.rollout.quantization.linear: FP8_BLOCK\n"
        "rollout.checkpoint_engine.update_weights_bucket_megabytes: 64\ntrainer:\n  total_epochs: 1\n")))
    nested = load_config({"actor_rollout_ref": {"actor": {"megatron": {"override_transformer_config": {
        "fp8": "e4m3", "fp8_recipe": "blockwise"}}}, "rollout": {"name": "vllm", "quantization": {"linear": "FP8_BLOCK"}}},
        "rollout": {"checkpoint_engine": {"update_weights_bucket_megabytes": 64}}, "trainer": {"total_epochs": 1}})
    overridden = load_config(None, [
        "actor_rollout_ref.actor.megatron.override_transformer_config.fp8=e4m3",
        "actor_rollout_ref.actor.megatron.override_transformer_config.fp8_recipe=blockwise",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.quantization.linear=FP8_BLOCK",
        "rollout.checkpoint_engine.update_weights_bucket_megabytes=64"])
    assert dotted == nested == overridden
    assert dotted.actor.megatron.override_transformer_config.fp8 == "e4m3"
    assert dotted.rollout.name == "vllm" and dotted.unused == ("trainer",)


@pytest.mark.parametrize(("text", "error", "match"), [
    ("rollout.quantization.linaer: FP8_BLOCK\n", UnknownConfigKey, "rollout.quantization.linaer"),
    ("rollout..name: vllm\n", UnknownConfigKey, "empty key"),
    ("actor_rollout_ref.rollout.name: vllm\nactor_rollout_ref:\n  rollout:\n    name: sglang\n", ConfigError,
     "set twice with different values"),
])
def test_a_bad_dotted_key_is_one_typed_error(tmp_path: Path, text: str, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        load_config(_write(tmp_path, text))
