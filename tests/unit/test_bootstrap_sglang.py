"""The composition root builds an SGLang engine from its factory, for the plan it is asked for
(without SGLang: the server launch is replaced by a recorder)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.bootstrap import bootstrap
from domain.errors import ConfigError
from domain.quant.plan import QuantizationPlan
from domain.refit.session import CommitMode

BASE = ["rollout.name=sglang", "reference.model=micro-moe", "rollout.quantization.linear=FP8_BLOCK",
        "rollout.quantization.moe=FP8_BLOCK", "rollout.engine_kwargs.sglang.hf_overrides={max_position_embeddings: 64}"]


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    import importlib.util

    from adapters.sglang import client

    real = importlib.util.find_spec  # SGLang "installed": its client is the recorder below
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "sglang" else real(name, *a))
    calls: list[dict[str, Any]] = []

    def launch(**kwargs: Any) -> object:
        calls.append(kwargs)
        return object()

    monkeypatch.setattr(client.EngineClient, "launch", staticmethod(launch))
    return calls


def test_the_configured_plan(launched: list[dict[str, Any]]) -> None:
    services = bootstrap(overrides=BASE)
    engine: Any = services.rollout_engine()
    (kwargs,) = launched
    assert engine.plan == services.plan and kwargs["quantization"] == "compressed-tensors"
    overrides = json.loads(kwargs["json_model_override_args"])
    assert overrides["max_position_embeddings"] == 64 and overrides["quantization_config"]["config_groups"]


def test_another_plan_starts_an_engine_for_that_plan(launched: list[dict[str, Any]]) -> None:
    services = bootstrap(overrides=BASE)
    engine: Any = services.rollout_engine(plan=QuantizationPlan.bf16())
    (kwargs,) = launched
    assert engine.plan == QuantizationPlan.bf16() and "quantization" not in kwargs
    assert json.loads(kwargs["json_model_override_args"]) == {"max_position_embeddings": 64}


def test_sglang_commits_transactionally_only(launched: list[dict[str, Any]]) -> None:
    services = bootstrap(overrides=BASE)
    with pytest.raises(ConfigError, match=r"rollout\.commit_mode: sglang commits transactional only"):
        services.rollout_engine(commit_mode=CommitMode.PER_LAYER)
    assert launched == []
