"""Fused-forward mode: aliases, precedence of configuration over environment, selection."""

from __future__ import annotations

import pytest
import torch

from app.bootstrap import bootstrap
from app.services.logprob import TokenScores
from domain.errors import ConfigError, FusedForwardModeError, FusedHookUnavailable, InvalidTensor
from domain.forward.mode import (
    MODE_ALIASES,
    FusedForwardMode,
    FusedForwardRequest,
    parse_fused_forward_mode,
    select_fused_forward_mode,
)

AUTO, HOOK, LEGACY = FusedForwardMode.AUTO, FusedForwardMode.HOOK, FusedForwardMode.LEGACY

def build_logprob_service(model, fused_forward=None, *, environ=None, **kwargs):  # type: ignore[no-untyped-def]
    """The composition root's LogProbService for `model`, with actor.fused_forward set."""
    cfg = {"actor": {"fused_forward": fused_forward}} if fused_forward is not None else None
    return bootstrap(cfg, environ=environ).trainer_side.logprob_service(model, **kwargs)



@pytest.mark.parametrize(
    ("value", "mode"),
    [
        (None, AUTO), ("", AUTO), ("auto", AUTO), (" AUTO ", AUTO),
        ("1", HOOK), ("true", HOOK), ("Yes", HOOK), ("HOOK", HOOK), (True, HOOK), (1, HOOK),
        ("0", LEGACY), ("FALSE", LEGACY), ("no", LEGACY), ("Legacy", LEGACY), (False, LEGACY), (0, LEGACY),
        (HOOK, HOOK),
    ],
)
def test_aliases(value, mode):
    assert parse_fused_forward_mode(value) is mode


def test_alias_table_is_the_documented_one():
    assert {k for k, v in MODE_ALIASES.items() if v is AUTO} == {"", "auto"}
    assert {k for k, v in MODE_ALIASES.items() if v is HOOK} == {"1", "true", "yes", "hook"}
    assert {k for k, v in MODE_ALIASES.items() if v is LEGACY} == {"0", "false", "no", "legacy"}


@pytest.mark.parametrize("value", ["2", "on", "hooks", 2, 1.0, ["hook"]])
def test_other_values_fail_naming_the_key_and_listing_accepted(value):
    with pytest.raises(FusedForwardModeError) as err:
        parse_fused_forward_mode(value, key="VERL_FUSED_USE_OP_HOOK")
    assert isinstance(err.value, (ConfigError, ValueError))
    assert err.value.key == "VERL_FUSED_USE_OP_HOOK"
    assert "accepted" in str(err.value) and "'legacy'" in str(err.value)


def test_configuration_wins_then_environment_then_default():
    assert FusedForwardRequest.from_settings("legacy", "1") == FusedForwardRequest(LEGACY, "actor.fused_forward")
    assert FusedForwardRequest.from_settings(None, "1") == FusedForwardRequest(HOOK, "VERL_FUSED_USE_OP_HOOK")
    assert FusedForwardRequest.from_settings(None, None) == FusedForwardRequest(AUTO, "default")
    # A set-but-empty configuration value means auto, and still wins over the environment.
    assert FusedForwardRequest.from_settings("", "0").mode is AUTO


def test_selection():
    assert select_fused_forward_mode(AUTO, hook_available=True, megatron_version="0.19.2") is HOOK
    assert select_fused_forward_mode(AUTO, hook_available=False, megatron_version="0.16.0") is LEGACY
    assert select_fused_forward_mode(LEGACY, hook_available=True, megatron_version="0.19.2") is LEGACY
    assert select_fused_forward_mode(HOOK, hook_available=True, megatron_version="0.19.2") is HOOK
    with pytest.raises(FusedHookUnavailable, match=r"0\.16\.0.*'auto' or 'legacy'"):
        select_fused_forward_mode(HOOK, hook_available=False, megatron_version="0.16.0")


class _FixedTrainer:
    """A TrainerModel whose scores are known: log-prob -1 and entropy 2 everywhere."""

    def named_weights(self):
        return iter(())

    def log_probs(self, input_ids, *, temperature=1.0):
        shape = (input_ids.shape[0], input_ids.shape[1] - 1)
        return torch.full(shape, -1.0 / temperature), torch.full(shape, 2.0)


def test_builder_parses_before_building_and_reads_the_given_environment():
    with pytest.raises(FusedForwardModeError, match="VERL_FUSED_USE_OP_HOOK"):
        build_logprob_service(_FixedTrainer(), None, environ={"VERL_FUSED_USE_OP_HOOK": "maybe"})
    service = build_logprob_service(_FixedTrainer(), None, environ={"VERL_FUSED_USE_OP_HOOK": "1"})
    assert (service.mode, service.source) == ("none", "VERL_FUSED_USE_OP_HOOK")
    scores = service.compute(torch.zeros(2, 5, dtype=torch.long), temperature=0.5)
    assert torch.equal(scores.log_probs, torch.full((2, 4), -2.0))
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    assert scores.mean_entropy(mask) == 2.0


def test_token_scores_validate_their_tensors():
    with pytest.raises(InvalidTensor, match="'entropy'"):
        TokenScores(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(InvalidTensor, match="'log_probs'"):
        TokenScores(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3))
    with pytest.raises(InvalidTensor, match="'mask'"):
        TokenScores(torch.zeros(2, 3), torch.zeros(2, 3)).mean_entropy(torch.ones(3, 2, dtype=torch.bool))


@pytest.mark.parametrize(
    "module", ["adapters.megatron.fused_forward", "adapters.megatron.thd", "adapters.megatron.trainer_model"]
)
def test_adapter_without_megatron_names_itself_and_the_package(monkeypatch, module):
    import importlib
    import sys

    for name in [m for m in sys.modules if m == "megatron" or m.startswith(("megatron.", "adapters.megatron."))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "megatron", None)  # import megatron -> ImportError
    with pytest.raises(ModuleNotFoundError, match=r"adapters\.megatron\.\w+ needs megatron-core") as err:
        importlib.import_module(module)
    assert err.value.name == "megatron.core"
