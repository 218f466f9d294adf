"""`actor.strategy: hf` through the composition root: a live transformers model passed as
`model=`, else model.path streamed; a refit of either into the reference engine goes live."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs transformers (the `test` extra)")

from app.bootstrap import bootstrap
from domain.errors import ConfigError


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):  # type: ignore[no-untyped-def]
    from adapters.hf.fixtures import write_fixture

    return write_fixture("tiny-qwen3", tmp_path_factory.mktemp("hf") / "tiny-qwen3")


def test_hf_without_a_model_or_a_path_says_what_to_pass() -> None:
    with pytest.raises(ConfigError, match=r"actor\.strategy.*set model\.path"):
        bootstrap(overrides=["actor.strategy=hf"]).trainer_model()


def test_hf_streams_model_path_and_wraps_a_live_model(tiny) -> None:
    from adapters.hf.checkpoint import HfCheckpointTrainer
    from adapters.hf.module import HfModuleTrainer

    streamed = bootstrap(overrides=["actor.strategy=hf", f"model.path={tiny}"]).trainer_model()
    assert isinstance(streamed, HfCheckpointTrainer) and streamed.tied
    live = HfModuleTrainer.from_pretrained(tiny).model
    wrapped = bootstrap(overrides=["actor.strategy=hf"], model=live).trainer_model()
    assert isinstance(wrapped, HfModuleTrainer) and wrapped.model is live
