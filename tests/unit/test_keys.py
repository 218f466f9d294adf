"""domain.keys.key: the one function that spells configuration keys in the domain's messages."""

from __future__ import annotations

import pytest

from domain.keys import SECTIONS, key


def test_a_key_is_its_section_prefix_and_names() -> None:
    assert key("quantization", "linear") == "rollout.quantization.linear"
    assert key("qat", "mode") == "actor.megatron.qat.mode"
    assert key("te", "fp8") == "actor.megatron.override_transformer_config.fp8"
    assert key("engine_kwargs", "sglang", "hf_overrides") == "rollout.engine_kwargs.sglang.hf_overrides"
    assert key("rollout", "name") == "rollout.name"
    assert key("megatron") == SECTIONS["megatron"] == "actor.megatron"


def test_an_unknown_section_is_a_bug_in_the_caller() -> None:
    with pytest.raises(KeyError):
        key("quantisation", "linear")
