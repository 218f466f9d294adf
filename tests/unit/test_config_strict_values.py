"""Configuration values are taken as written or refused: no coercion of an integer key's 128.5 or
"128", no last-one-wins for a key a YAML file gives twice, no NaN or infinite bound, and the public
entry points refuse arguments of the wrong type with a typed error naming the argument."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.bootstrap import bootstrap
from app.cli.main import main
from app.config import load_config
from domain.errors import ConfigError, ConfigTypeError


@pytest.mark.parametrize("override", [
    "rollout.verify.max_abs_logp_diff=.nan",  # before: accepted; every refit then failed ProbeMismatch (bound nan)
    "rollout.verify.max_abs_logp_diff=.inf",
    "actor.lora.alpha=.inf",
    "rollout.checkpoint_engine.update_weights_bucket_megabytes=.nan",
    "rollout.engine_kwargs.vllm.start_timeout_s=.inf",
])
def test_a_nan_or_infinite_number_is_refused_naming_the_key(override: str) -> None:
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as info:
        load_config(overrides=[override])
    assert "finite" in str(info.value) or "positive" in str(info.value)


@pytest.mark.parametrize("override", [
    "rollout.replicas=1.5", "rollout.replicas='2'", "rollout.verify.batch=2.0", "reference.seed=512.9",
    "rollout.verify.seq_len=true", "actor.megatron.tensor_model_parallel_size='128'",
])
def test_an_integer_key_takes_no_float_string_or_bool(override: str) -> None:
    with pytest.raises(ConfigTypeError, match="expected int"):
        load_config(overrides=[override])


@pytest.mark.parametrize(("text", "key", "lines"), [
    ("rollout:\n  name: reference\nrollout:\n  name: vllm\n", "rollout", (1, 3)),
    ("rollout:\n  verify:\n    batch: 2\n    enabled: true\n    batch: 4\n", "batch", (3, 5)),
])
def test_a_key_given_twice_in_a_yaml_file_is_refused_naming_both_lines(
        tmp_path: Path, text: str, key: str, lines: tuple[int, int]) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:  # before: the last value won, silently
        load_config(path)
    message = str(info.value)
    assert f"key {key!r} is given twice" in message and f"line {lines[0]} and line {lines[1]}" in message


def test_the_cli_reports_a_duplicate_key_on_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("reference:\n  seed: 1\n  seed: 2\n")
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ConfigError" in err[0] and "'seed' is given twice" in err[0], err


def test_equal_keys_in_different_sections_are_not_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  verify:\n    enabled: true\nactor:\n  lora:\n    rank: 0\nreference:\n  seed: 4\n")
    assert load_config(path).reference.seed == 4


@pytest.mark.parametrize(("call", "argument"), [
    (lambda: bootstrap(overrides=[1]), "overrides"),  # before: AttributeError
    (lambda: bootstrap(overrides="reference.seed=1"), "overrides"),  # before: read one character at a time
    (lambda: bootstrap(overrides=None), "overrides"),
    (lambda: bootstrap(config=5), "config"),
    (lambda: bootstrap().refit_service(plan="FP8"), "plan"),  # before: AttributeError
    (lambda: bootstrap().refit_service(fault_after="1"), "fault_after"),
    (lambda: bootstrap().rollout_engine(plan={"linear": "FP8_BLOCK"}), "plan"),  # type: ignore[arg-type]
    (lambda: bootstrap().plan_report(plan="FP8"), "plan"),  # type: ignore[arg-type]
])
def test_a_public_entry_point_refuses_an_argument_of_the_wrong_type(call, argument: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigTypeError) as info:
        call()
    assert info.value.key == argument and isinstance(info.value, TypeError)


def test_a_megatron_pipeline_the_layers_do_not_split_over_is_refused_before_any_process(
        capsys: pytest.CaptureFixture[str]) -> None:
    # before: exit 1 after four ranks each printed Megatron-Core's assertion (about 150 lines)
    assert main(["demo", "megatron", "--pp", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["refit demo: ConfigError: --pp: 3 does not divide the 4 layers of tiny-moe; use a divisor of 4"]
