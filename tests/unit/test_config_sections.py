"""The typed configuration: frozen sections that match the key table, validated however they are built."""

from __future__ import annotations

import attrs
import pytest

from adapters.vllm.config import VllmEngineConfig
from app.config import KEYS, build_config, load_config
from app.config_sections import (
    CheckpointEngineConfig,
    QuantizationConfig,
    RefitConfig,
    RolloutConfig,
    section_keys,
)
from domain.errors import ConfigError, ConfigTypeError


def test_every_key_is_one_typed_field_at_its_own_path() -> None:
    fields = section_keys()
    assert set(fields) == set(KEYS)
    assert all(path == key for path, key in fields.items())


def test_defaults_are_the_key_tables() -> None:
    cfg = RefitConfig()
    assert all(cfg[path] == key.default for path, key in KEYS.items())
    assert cfg == load_config()


def test_built_in_python_equals_loaded_from_overrides() -> None:
    typed = RefitConfig(rollout=RolloutConfig(
        name="vllm", quantization=QuantizationConfig(linear="fp8_block", ignore=("lm_head",)),
        checkpoint_engine=CheckpointEngineConfig(update_weights_bucket_megabytes=64)))
    loaded = build_config({}, ["rollout.name=vllm", "rollout.quantization.linear=FP8_BLOCK",
                               "rollout.quantization.ignore=[lm_head]",
                               "rollout.checkpoint_engine.update_weights_bucket_megabytes=64"])
    assert typed == loaded
    assert typed.rollout.quantization.linear == "FP8_BLOCK" and typed.rollout.quantization.ignore == ("lm_head",)


def test_a_value_set_in_python_gets_the_keys_error() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.name") as err:
        RolloutConfig(name="tgi")
    assert "valid: vllm, sglang" in str(err.value)
    with pytest.raises(ConfigTypeError, match="update_weights_bucket_megabytes"):
        CheckpointEngineConfig(update_weights_bucket_megabytes="big")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"rollout\.engine_kwargs\.vllm\.hf_overrides.*not valid JSON"):
        VllmEngineConfig(hf_overrides="{oops")  # type: ignore[arg-type]


def test_evolve_checks_the_new_value_and_keeps_the_rest() -> None:
    cfg = load_config(None, ["rollout.quantization.moe=nvfp4"])
    changed = attrs.evolve(cfg, rollout=attrs.evolve(cfg.rollout, name="sglang"))
    assert (changed.rollout.name, changed.rollout.quantization.moe) == ("sglang", "NVFP4")
    with pytest.raises(ConfigError, match=r"rollout\.quantization\.linear"):
        attrs.evolve(cfg.rollout.quantization, linear="FP9")


def test_sections_are_frozen() -> None:
    cfg = load_config()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cfg.rollout.name = "vllm"  # type: ignore[misc]


def test_to_dict_loads_back_to_an_equal_configuration() -> None:
    cfg = build_config({}, ["rollout.engine_kwargs.vllm.hf_overrides={max_model_len: 64}",
                            "actor.megatron.qat.ignore_patterns=[lm_head]", "model.path=/m"])
    assert load_config(cfg.to_dict()) == cfg
    assert cfg.to_dict()["actor"]["megatron"]["qat"]["ignore_patterns"] == ["lm_head"]
    assert "unused" not in cfg.to_dict()


def test_dotted_lookup_and_engine_sections() -> None:
    cfg = build_config({}, ["rollout.engine_kwargs.sglang.use_deep_gemm=false"])
    assert cfg["rollout.engine_kwargs.sglang.use_deep_gemm"] is False
    assert cfg.get("rollout.nope", "absent") == "absent"
    with pytest.raises(KeyError):
        cfg["unused"]
    sglang = cfg.rollout.engine_kwargs.engine("sglang")
    assert sglang is not None and sglang.use_deep_gemm is False
    assert cfg.rollout.engine_kwargs.engine("reference") is None


def test_unused_verl_keys_travel_beside_the_values() -> None:
    cfg = build_config({"actor_rollout_ref": {"rollout": {"name": "vllm", "n": 4}}})
    assert cfg.unused == ("actor_rollout_ref.rollout.n",)
    assert cfg == build_config({}, ["rollout.name=vllm"])  # not part of the configuration's value
