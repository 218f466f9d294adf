"""The real-size fixtures have the released models' shapes (built on the meta device: no weights
are made), and the tiny ones keep their structure."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs transformers (the `test` extra)")

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from adapters.hf.fixtures import FIXTURES, write_fixture


def _meta_model(name: str):  # type: ignore[no-untyped-def]
    model_type, keys = FIXTURES[name]
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **keys))


def test_qwen3_0_6b_has_the_released_shapes_and_a_tied_head() -> None:
    model = _meta_model("qwen3-0.6b")
    params = dict(model.named_parameters())
    assert 0.59e9 < sum(p.numel() for p in params.values()) < 0.60e9  # Qwen3-0.6B: 0.6B, 0.44B without embeddings
    assert "lm_head.weight" not in params and model.lm_head.weight is model.model.embed_tokens.weight
    assert params["model.embed_tokens.weight"].shape == (151936, 1024)
    assert params["model.layers.27.self_attn.q_proj.weight"].shape == (16 * 128, 1024)
    assert params["model.layers.27.self_attn.k_proj.weight"].shape == (8 * 128, 1024)
    assert params["model.layers.27.mlp.down_proj.weight"].shape == (1024, 3072)
    untied = _meta_model("qwen3-0.75b-untied")
    assert 0.74e9 < sum(p.numel() for p in untied.parameters()) < 0.76e9


def test_the_moe_fixture_has_fused_experts_in_the_model_and_per_expert_names_on_disk(tmp_path) -> None:
    model = _meta_model("qwen3-moe-small")
    assert dict(model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"].shape == (32, 2 * 384, 1024)
    from safetensors import safe_open

    path = write_fixture("tiny-qwen3-moe", tmp_path / "m")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names and "lm_head.weight" not in names


def test_an_unknown_fixture_is_named() -> None:
    with pytest.raises(KeyError, match=r"valid: qwen3-0\.6b"):
        write_fixture("qwen3-9b", "/nonexistent")
