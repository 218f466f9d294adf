"""HF naming patterns, fused groups, layer order and the ignore matcher (with property tests)."""

from __future__ import annotations

import fnmatch
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from domain.quant import naming

CASES = [
    # name, shape, kind, group
    ("model.layers.0.self_attn.q_proj.weight", (64, 64), "dense", "model.layers.0.self_attn.qkv"),
    ("model.layers.0.self_attn.k_proj.weight", (32, 64), "dense", "model.layers.0.self_attn.qkv"),
    ("model.layers.0.self_attn.v_proj.weight", (32, 64), "dense", "model.layers.0.self_attn.qkv"),
    ("model.layers.0.self_attn.o_proj.weight", (64, 64), "dense", None),
    ("model.layers.1.mlp.gate_proj.weight", (128, 64), "dense", "model.layers.1.mlp.gate_up"),
    ("model.layers.1.mlp.up_proj.weight", (128, 64), "dense", "model.layers.1.mlp.gate_up"),
    ("model.layers.1.mlp.down_proj.weight", (64, 128), "dense", None),
    ("model.layers.2.mlp.experts.5.gate_proj.weight", (32, 64), "expert", "model.layers.2.mlp.experts.5.gate_up"),
    ("model.layers.2.mlp.experts.5.up_proj.weight", (32, 64), "expert", "model.layers.2.mlp.experts.5.gate_up"),
    ("model.layers.2.mlp.experts.5.down_proj.weight", (64, 32), "expert", None),
    ("model.layers.0.block_sparse_moe.experts.1.w1.weight", (32, 64), "expert", "model.layers.0.block_sparse_moe.experts.1.w1_w3"),
    ("model.layers.0.block_sparse_moe.experts.1.w3.weight", (32, 64), "expert", "model.layers.0.block_sparse_moe.experts.1.w1_w3"),
    ("model.layers.0.block_sparse_moe.experts.1.w2.weight", (64, 32), "expert", None),
    ("model.layers.3.mlp.experts.gate_up_proj", (4, 64, 64), "expert", None),
    ("model.layers.3.mlp.experts.down_proj", (4, 64, 32), "expert", None),
    ("model.layers.3.mlp.shared_expert.gate_proj.weight", (64, 64), "dense", "model.layers.3.mlp.shared_expert.gate_up"),
    ("model.layers.3.mlp.shared_experts.down_proj.weight", (64, 64), "dense", None),
    ("model.layers.3.mlp.gate.weight", (4, 64), "passthrough", None),
    ("model.layers.3.mlp.router.weight", (4, 64), "passthrough", None),
    ("model.layers.3.mlp.shared_expert_gate.weight", (1, 64), "passthrough", None),
    ("lm_head.weight", (256, 64), "passthrough", None),
    ("model.embed_tokens.weight", (256, 64), "passthrough", None),
    ("model.language_model.embed_tokens.weight", (256, 64), "passthrough", None),
    ("language_model.model.embed_tokens.weight", (256, 64), "passthrough", None),
    ("language_model.lm_head.weight", (256, 64), "passthrough", None),
    ("model.language_model.layers.0.self_attn.q_proj.weight", (64, 64), "dense", "model.language_model.layers.0.self_attn.qkv"),
    ("language_model.model.layers.0.mlp.experts.2.up_proj.weight", (32, 64), "expert", "language_model.model.layers.0.mlp.experts.2.gate_up"),
    ("model.visual.blocks.0.attn.qkv.weight", (96, 32), "passthrough", None),
    ("model.layers.0.linear_attn.in_proj_qkvz.weight", (192, 64), "dense", None),
    ("model.layers.0.linear_attn.in_proj_ba.weight", (16, 64), "passthrough", None),
    ("model.layers.0.linear_attn.in_proj_b.weight", (8, 64), "passthrough", None),
    ("model.layers.0.linear_attn.in_proj_qkv.weight", (128, 64), "dense", None),
    ("model.layers.0.linear_attn.out_proj.weight", (64, 64), "dense", None),
    ("model.layers.0.linear_attn.conv1d.weight", (128, 1, 4), "passthrough", None),
    ("model.layers.0.linear_attn.A_log", (8,), "passthrough", None),
    ("model.layers.0.linear_attn.dt_bias", (8,), "passthrough", None),
    ("model.layers.0.linear_attn.norm.weight", (16,), "passthrough", None),
    ("model.layers.0.input_layernorm.weight", (64,), "passthrough", None),
    ("model.layers.0.self_attn.q_proj.bias", (64,), "passthrough", None),
]


@pytest.mark.parametrize(("name", "shape", "kind", "group"), CASES, ids=[c[0] for c in CASES])
def test_classify(name: str, shape: tuple[int, ...], kind: str, group: str | None) -> None:
    cls = naming.classify(name, shape)
    assert (cls.kind, cls.group) == (kind, group)
    assert cls.reason


def test_router_and_lm_head_reasons_name_the_default_entry() -> None:
    assert "mlp\\.gate$" in naming.classify("model.layers.0.mlp.gate.weight", (4, 64)).reason
    assert "lm_head" in naming.classify("lm_head.weight", (8, 64)).reason
    assert naming.classify("model.layers.0.mlp.gate_up_proj.weight", (8, 64)).kind == "dense"


def test_group_members() -> None:
    assert naming.group_members("m.layers.0.self_attn.qkv") == (
        "m.layers.0.self_attn.q_proj", "m.layers.0.self_attn.k_proj", "m.layers.0.self_attn.v_proj")
    assert naming.group_members("m.experts.3.gate_up") == ("m.experts.3.gate_proj", "m.experts.3.up_proj")
    assert naming.group_members("m.experts.3.w1_w3") == ("m.experts.3.w1", "m.experts.3.w3")


def test_layer_index_module_name_and_natural_order() -> None:
    assert naming.layer_index("model.layers.12.mlp.down_proj.weight") == 12
    assert naming.layer_index("model.language_model.layers.3.x.weight") == 3
    assert naming.layer_index("lm_head.weight") is None
    assert naming.module_name("a.b.weight") == "a.b"
    assert naming.module_name("a.experts.gate_up_proj") == "a.experts.gate_up_proj"
    names = ["model.layers.10.a", "model.layers.2.a", "model.layers.1.b", "model.layers.1.a"]
    assert sorted(names, key=naming.natural_key) == ["model.layers.1.a", "model.layers.1.b", "model.layers.2.a", "model.layers.10.a"]


def test_expert_split() -> None:
    split = naming.expert_split("m.layers.0.mlp.experts.gate_up_proj", (2, 8, 4))
    assert [(m, e, (s.start, s.stop)) for m, e, s in split] == [
        ("m.layers.0.mlp.experts.0.gate_proj", 0, (0, 4)), ("m.layers.0.mlp.experts.0.up_proj", 0, (4, 8)),
        ("m.layers.0.mlp.experts.1.gate_proj", 1, (0, 4)), ("m.layers.0.mlp.experts.1.up_proj", 1, (4, 8))]
    down = naming.expert_split("m.layers.0.mlp.experts.down_proj", (2, 4, 8))
    assert [m for m, _, _ in down] == ["m.layers.0.mlp.experts.0.down_proj", "m.layers.0.mlp.experts.1.down_proj"]
    with pytest.raises(ValueError, match=r"not a fused 3-D expert"):
        naming.expert_split("m.layers.0.mlp.down_proj.weight", (4, 8))


# --- ignore matcher ----------------------------------------------------------------------------

@pytest.mark.parametrize(("entry", "name", "expected"), [
    ("lm_head", "lm_head.weight", True),
    ("lm_head", "language_model.lm_head.weight", True),
    ("mlp.gate", "model.layers.0.mlp.gate.weight", True),
    ("mlp.gate", "model.layers.0.mlp.gate_proj.weight", False),
    ("mlp.gate", "model.layers.0.mlp.gate_up_proj.weight", False),
    ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.q_proj.weight", True),
    ("model.layers.0.self_attn.q_proj", "model.layers.10.self_attn.q_proj.weight", False),
    ("re:.*mlp\\.gate$", "model.layers.0.mlp.gate.weight", True),
    ("re:.*mlp\\.gate$", "model.layers.0.mlp.gate_proj.weight", False),
    ("re:model\\.layers\\.1\\.", "model.layers.1.mlp.down_proj.weight", True),
    ("re:layers\\.1\\.", "model.layers.1.mlp.down_proj.weight", False),  # re.match anchors at the start
    ("*mlp.gate", "model.layers.0.mlp.gate.weight", True),
    ("*mlp.gate", "model.layers.0.mlp.gate_proj.weight", False),
    ("*output_layer*", "output_layer.weight", True),
    ("*.layers.[01].*", "model.layers.1.self_attn.q_proj.weight", True),
    ("*.layers.[01].*", "model.layers.2.self_attn.q_proj.weight", False),
])
def test_ignore_entry_syntax(entry: str, name: str, expected: bool) -> None:
    assert naming.ignore_matches(entry, name) is expected


def test_first_match_and_validation() -> None:
    assert naming.first_match(["x", "re:.*q_proj$", "q_proj"], "a.q_proj.weight") == "re:.*q_proj$"
    assert naming.first_match(["x"], "a.q_proj.weight") is None
    assert naming.validate_ignore_entry("re:(") is not None
    assert naming.validate_ignore_entry("") is not None
    assert naming.validate_ignore_entry("lm_head") is None


ident = st.from_regex(r"[a-z][a-z0-9_]{0,7}", fullmatch=True)
dotted = st.lists(st.one_of(ident, st.integers(0, 99).map(str)), min_size=1, max_size=5).map(".".join)


@given(prefix=dotted, leaf=ident)
def test_property_suffix_matches_only_at_dot_boundary(prefix: str, leaf: str) -> None:
    assert naming.ignore_matches(leaf, f"{prefix}.{leaf}.weight")
    assert naming.ignore_matches(f"{prefix}.{leaf}", f"{prefix}.{leaf}.weight")
    assert not naming.ignore_matches(leaf, f"{prefix}.{leaf}x.weight")
    assert not naming.ignore_matches(leaf, f"{prefix}.x{leaf}.weight")


@given(module=dotted)
def test_property_mlp_gate_never_matches_gate_projections(module: str) -> None:
    for proj in ("gate_proj", "gate_up_proj"):
        name = f"{module}.mlp.{proj}.weight"
        assert not naming.ignore_matches("mlp.gate", name)
        assert naming.first_match(naming.DEFAULT_IGNORE, name) is None


@given(module=dotted, pattern=st.sampled_from([r".*q_proj$", r"model\.layers\.\d+\..*", r".*\.(0|1)\..*", r"lm_head"]))
def test_property_regex_entries_follow_re_match(module: str, pattern: str) -> None:
    name = f"{module}.weight"
    expected = re.match(pattern, module) is not None or re.match(pattern, name) is not None
    assert naming.ignore_matches("re:" + pattern, name) is expected


@given(module=dotted, pattern=st.sampled_from(["*mlp.gate", "*.0.*", "model.*", "*q_proj", "*[0-3]*"]))
def test_property_fnmatch_entries_follow_fnmatchcase(module: str, pattern: str) -> None:
    name = f"{module}.weight"
    expected = fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(name, pattern)
    assert naming.ignore_matches(pattern, name) is expected


@given(module=dotted, entry=st.one_of(ident, dotted, st.sampled_from(["*mlp.gate", "*.1.*", "lm_head"])))
def test_property_engine_pattern_matches_the_same_modules(module: str, entry: str) -> None:
    # what the engine reads (re.match on module names) keeps exactly what the trainer keeps
    engine = naming.to_engine_pattern(entry)
    assert engine.startswith("re:")
    assert (re.match(engine[3:], module) is not None) is naming._entry_matches(entry, module)
