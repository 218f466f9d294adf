"""Configuration schema: defaults, YAML and dict loading, dotted overrides, errors naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.config import KEYS, SCHEMA, build_config, load_config, parse_override
from domain.errors import ConfigError, ConfigTypeError, RemovedConfigKey, UnknownConfigKey

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_defaults() -> None:
    cfg = build_config()
    assert cfg.rollout.name == "reference"
    assert cfg.rollout.quantization.linear is None and cfg.rollout.quantization.ignore == ()
    assert cfg["rollout.checkpoint_engine.update_weights_bucket_megabytes"] == 512
    assert cfg.actor.megatron.qat.enable is False
    assert cfg.rollout.quantization.numerics == "engine" and cfg.rollout.quantization.scale_rule is None
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
    ({"nope": 1}, [], UnknownConfigKey, "nope", "actor, model, reference, rollout"),
    ({}, ["rollout.quantization.lienar=FP8_BLOCK"], UnknownConfigKey, "rollout.quantization.lienar", "valid keys under"),
    ({"rollout": {"quantization": {"linear": 8}}}, [], ConfigTypeError, "rollout.quantization.linear", "expected str or null, got int"),
    ({"actor": {"megatron": {"qat": {"enable": "yes"}}}}, [], ConfigTypeError, "actor.megatron.qat.enable", "expected bool"),
    ({}, ["rollout.checkpoint_engine.update_weights_bucket_megabytes=true"], ConfigTypeError,
     "rollout.checkpoint_engine.update_weights_bucket_megabytes", "expected int or float, got bool"),
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
    ({}, ["rollout.quantization.numerics=vllm"], ConfigError, "rollout.quantization.numerics",
     "valid: engine, compressed-tensors"),
    ({}, ["rollout.quantization.scale_rule=floor"], ConfigError, "rollout.quantization.scale_rule",
     "valid: null, rceil, even"),
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


def test_the_keys_table_is_generated_from_the_declarations() -> None:
    """docs/configuration.md's table of keys is `keys_table(SCHEMA)`, line for line: each key's
    types, default and meaning come from its one declaration (app.config_sections). To refresh it:
    `python -c "from app.config_sections import SCHEMA; from domain.settings import keys_table;
    print(keys_table(SCHEMA))"`."""
    from domain.settings import keys_table

    section = DOCS.read_text().split("\n## Keys\n", 1)[1]
    table = section[section.index("| key | type | default | meaning |"):].split("\n\n", 1)[0]
    assert table.splitlines() == keys_table(SCHEMA).splitlines()


def test_a_key_is_declared_once_on_its_field() -> None:
    """SCHEMA is derived from the sections' fields: every key is one field, at its own path."""
    from app.config_sections import section_keys

    assert section_keys() == {k.path: k.path for k in SCHEMA}
    assert len(KEYS) == len(SCHEMA)


# --- verl's keys and names ------------------------------------------------------------------------

VERL_YAML = Path(__file__).resolve().parents[1] / "data" / "verl_ppo_megatron.yaml"


@pytest.mark.parametrize("override", ["rollout.quantization.linear=FP8_BLOCK", "rollout.checkpoint_engine.backend=nccl",
                                      "actor.megatron.qat.mode=mxfp4_mxfp8", "model.path=/m"])
def test_the_actor_rollout_ref_prefix_is_the_same_key(override: str) -> None:
    plain = build_config({}, [override])
    assert build_config({}, ["actor_rollout_ref." + override]).to_dict() == plain.to_dict()
    assert build_config({}, ["+actor_rollout_ref." + override]).to_dict() == plain.to_dict()  # hydra's add syntax
    key, _, value = override.partition("=")
    tree: dict = {}
    node = tree.setdefault("actor_rollout_ref", {})
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    assert build_config(tree).to_dict() == plain.to_dict()


def test_a_verl_file_loads_unchanged_and_sets_verls_own_keys_aside() -> None:
    cfg = load_config(VERL_YAML)
    assert (cfg.rollout.name, cfg.rollout.quantization.linear, cfg.rollout.quantization.moe) == ("vllm", "FP8_BLOCK", "FP8_BLOCK")
    assert cfg.rollout.checkpoint_engine.update_weights_bucket_megabytes == 2048
    assert (cfg.actor.megatron.qat.enable, cfg.actor.megatron.qat.mode) == (True, "fp8")
    assert cfg.actor.megatron.qat.ignore_patterns == ("lm_head", "*mlp.gate")
    assert cfg.rollout.quantization.config_file is None  # verl's null quantization_config_file sets nothing
    # the highest key rl-refit does not read: a whole section (data, optim) or a single value
    assert {"data", "trainer", "algorithm", "actor_rollout_ref.actor.optim",
            "actor_rollout_ref.rollout.temperature", "actor_rollout_ref.actor.megatron.qat.group_size",
            "actor_rollout_ref.rollout.engine_kwargs.trtllm"} <= set(cfg.unused)
    assert not any(k.endswith("_target_") for k in cfg.unused)


def test_rl_refits_own_section_stays_strict_inside_a_verl_file() -> None:
    tree = {"actor_rollout_ref": {"rollout": {"quantization": {"lienar": "FP8_BLOCK"}}}, "data": {"x": 1}}
    with pytest.raises(UnknownConfigKey, match=r"did you mean 'rollout.quantization.linear'") as err:
        build_config(tree)
    assert err.value.key == "rollout.quantization.lienar"
    with pytest.raises(UnknownConfigKey):  # without verl's layout, every key is checked
        build_config({"data": {"x": 1}})


@pytest.mark.parametrize(("tree", "overrides"), [
    ({}, ["rollout.quantization=fp8"]),
    ({"rollout": {"quantization": "fp8"}}, []),
    ({"actor_rollout_ref": {"rollout": {"quantization": "fp8"}}}, []),
])
def test_the_removed_string_form_says_what_replaced_it(tree, overrides) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RemovedConfigKey, match=r"was removed; write rollout.quantization.linear=FP8_BLOCK and "
                                               r"rollout.quantization.moe=FP8_BLOCK") as err:
        build_config(tree, overrides)
    assert err.value.key == "rollout.quantization" and "did you mean" not in str(err.value)
    with pytest.raises(RemovedConfigKey, match=r"linear=MXFP8 and rollout.quantization.moe=MXFP8"):
        build_config({}, ["rollout.quantization=mxfp8"])
    assert build_config({"rollout": {"quantization": None}}).rollout.quantization.linear is None


@pytest.mark.parametrize("mode", ["fp8", "mxfp8", "mxfp4", "mxfp4_mxfp8", "nvfp4", "NVFP4", "FP8_BLOCK", "w4a16", "w4a4"])
def test_qat_modes_by_verls_names_are_accepted_as_written(mode: str) -> None:
    assert build_config({}, [f"actor.megatron.qat.mode={mode}"]).actor.megatron.qat.mode == mode


def test_an_unknown_qat_mode_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown QAT mode 'int4'; valid: fp8, mxfp8, mxfp4, mxfp4_mxfp8, nvfp4"):
        build_config({}, ["actor.megatron.qat.mode=int4"])


def test_verls_config_file_keys_are_aliases() -> None:
    cfg = build_config({}, ["actor_rollout_ref.rollout.quantization_config_file=q.json"])
    assert cfg.rollout.quantization.config_file == "q.json"
    cfg = build_config({"actor_rollout_ref": {"actor": {"megatron": {"qat": {"quantization_config_path": "q.json"}}}}})
    assert cfg.rollout.quantization.config_file == "q.json"
    with pytest.raises(ConfigError, match=r"set twice with different values"):
        build_config({"actor_rollout_ref": {"rollout": {"quantization_config_file": "a.json",
                                                        "quantization": {"config_file": "b.json"}}}})
