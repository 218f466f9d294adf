"""Configuration schema: defaults, YAML and dict loading, dotted overrides, errors naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.config import KEYS, SCHEMA, build_config, load_config, parse_override
from domain.errors import ConfigError, ConfigTypeError, UnknownConfigKey

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_defaults() -> None:
    cfg = build_config()
    assert cfg.rollout.name == "reference"
    assert cfg.rollout.quantization.linear is None and cfg.rollout.quantization.ignore == ()
    assert cfg["rollout.checkpoint_engine.update_weights_bucket_megabytes"] == 512
    assert cfg.actor.megatron.qat.enable is False
    assert set(KEYS) == {k.path for k in SCHEMA}


def test_yaml_file_then_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("rollout:\n  name: vllm\n  quantization:\n    linear: fp8_block\n    ignore: [lm_head]\n")
    cfg = load_config(f, ["rollout.quantization.moe=nvfp4", "rollout.quantization.linear=null"])
    assert (cfg.rollout.name, cfg.rollout.quantization.linear, cfg.rollout.quantization.moe) == ("vllm", None, "NVFP4")
    assert cfg.rollout.quantization.ignore == ("lm_head",)
    assert cfg.to_dict()["rollout"]["quantization"]["ignore"] == ["lm_head"]


def test_hf_overrides_dict_json_string_and_dotted() -> None:
    a = build_config({"rollout": {"engine_kwargs": {"vllm": {"hf_overrides": '{"quantization_config": null}'}}}})
    assert a.rollout.engine_kwargs.vllm.hf_overrides == {"quantization_config": None}
    b = build_config({}, ["rollout.engine_kwargs.sglang.hf_overrides.quantization_config=null",
                          "rollout.engine_kwargs.sglang.hf_overrides.max_model_len=4096"])
    assert b["rollout.engine_kwargs.sglang.hf_overrides"] == {"quantization_config": None, "max_model_len": 4096}


@pytest.mark.parametrize(("tree", "overrides", "error", "key", "text"), [
    ({"rollout": {"quantizaton": {}}}, [], UnknownConfigKey, "rollout.quantizaton", "did you mean 'rollout.quantization'"),
    ({"rollout": {"quantization": {"linaer": "MXFP8"}}}, [], UnknownConfigKey, "rollout.quantization.linaer", "linear, linear_activation"),
    ({"nope": 1}, [], UnknownConfigKey, "nope", "actor, model, rollout"),
    ({}, ["rollout.quantization.lienar=FP8_BLOCK"], UnknownConfigKey, "rollout.quantization.lienar", "valid keys under"),
    ({"rollout": {"quantization": {"linear": 8}}}, [], ConfigTypeError, "rollout.quantization.linear", "expected str or null, got int"),
    ({"actor": {"megatron": {"qat": {"enable": "yes"}}}}, [], ConfigTypeError, "actor.megatron.qat.enable", "expected bool"),
    ({}, ["rollout.checkpoint_engine.update_weights_bucket_megabytes=true"], ConfigTypeError,
     "rollout.checkpoint_engine.update_weights_bucket_megabytes", "expected int, got bool"),
    ({}, ["rollout.checkpoint_engine.update_weights_bucket_megabytes=0"], ConfigError,
     "rollout.checkpoint_engine.update_weights_bucket_megabytes", "must be positive"),
    ({"rollout": 3}, [], ConfigTypeError, "rollout", "is a section, not a value"),
    ({}, ["rollout=5"], ConfigTypeError, "rollout", "set one of its keys"),
    ({}, ["rollout.name=tgi"], ConfigError, "rollout.name", "valid: vllm, sglang, trtllm, reference"),
    ({}, ["rollout.quantization.linear=FP9"], ConfigError, "rollout.quantization.linear", "valid: BF16, FP8_BLOCK"),
    ({}, ["rollout.quantization.moe_activation=fp16"], ConfigError, "rollout.quantization.moe_activation", "nvfp4_per_token"),
    ({}, ["rollout.quantization.ignore=['re:(']"], ConfigError, "rollout.quantization.ignore", "invalid regular expression"),
    ({}, ["rollout.engine_kwargs.vllm.hf_overrides={oops"], ConfigError, "rollout.engine_kwargs.vllm.hf_overrides", "not valid YAML"),
    ({}, ["rollout.engine_kwargs.vllm.hf_overrides='{oops'"], ConfigError, "rollout.engine_kwargs.vllm.hf_overrides", "not valid JSON"),
    ({}, ["rollout.checkpoint_engine.backend=carrier_pigeon"], ConfigError, "rollout.checkpoint_engine.backend", "delta_sharded"),
    ({}, ["actor.megatron.override_transformer_config.fp4_recipe=mxfp4"], ConfigError,
     "actor.megatron.override_transformer_config.fp4_recipe", "nvfp4"),
])
def test_errors_name_the_key_and_the_valid_values(tree, overrides, error, key, text) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=text) as err:
        build_config(tree, overrides)
    assert err.value.key == key
    assert str(err.value).startswith(key)


def test_override_syntax() -> None:
    assert parse_override("a.b=[x, 're:.*']") == ("a.b", ["x", "re:.*"])
    assert parse_override("a.b=") == ("a.b", None)
    with pytest.raises(ConfigError, match=r"KEY=VALUE"):
        parse_override("rollout.quantization.linear")


def test_missing_or_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [unclosed\n")
    with pytest.raises(ConfigError, match=r"not valid YAML"):
        load_config(bad)


def test_every_key_is_documented() -> None:
    text = DOCS.read_text()
    missing = [k.path for k in SCHEMA if f"`{k.path}`" not in text]
    assert not missing, f"docs/configuration.md lacks {missing}"
