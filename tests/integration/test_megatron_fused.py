"""Fused log-prob forward on a real megatron-core GPTModel (local spec, CPU, gloo world size 1)."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (the `megatron` extra)")

from adapters.megatron.fused_forward import (
    BACKUP_ATTR,
    MODE_ATTR,
    FusedContext,
    fused_output,
    is_patched,
    make_output_processor,
    patch_fused_forward,
    resolve_fused_forward,
    stored_mode,
    unpatch_fused_forward,
)
from adapters.megatron.trainer_model import MegatronTrainerModel
from app.bootstrap import bootstrap
from domain.errors import FusedForwardModeError, FusedHookUnavailable, InvalidTemperature
from domain.forward.mode import FusedForwardMode
from tests.megatron_cpu import causal_mask, megatron_cpu_env, tiny_gpt_model  # noqa: F401

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("megatron_cpu_env")]
VOCAB = 64
HOOK, LEGACY, AUTO = FusedForwardMode.HOOK, FusedForwardMode.LEGACY, FusedForwardMode.AUTO

def build_logprob_service(model, fused_forward=None, *, environ=None, **kwargs):  # type: ignore[no-untyped-def]
    """The composition root's LogProbService for `model`, with actor.fused_forward set."""
    cfg = {"actor": {"fused_forward": fused_forward}} if fused_forward is not None else None
    return bootstrap(cfg, environ=environ).trainer_side.logprob_service(model, **kwargs)



def _old_forward_class():
    """A GPTModel whose forward has the pre-0.18 signature (no output_processor parameters)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    class OldGPTModel(GPTModel):
        def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                    inference_context=None, packed_seq_params=None, extra_block_kwargs=None,
                    runtime_gather_output=None, *, inference_params=None, loss_mask=None):
            return super().forward(input_ids, position_ids, attention_mask, decoder_input, labels,
                                   inference_context, packed_seq_params, extra_block_kwargs,
                                   runtime_gather_output, inference_params=inference_params,
                                   loss_mask=loss_mask)

    return OldGPTModel


def _ids(batch=2, seq=12, seed=3):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def plain_from_logits(model, ids, tau):
    """Plain log_softmax on the model's own logits (the original forward, labels=None)."""
    seq = ids.shape[1]
    logits = model(ids, torch.arange(seq).expand_as(ids), causal_mask(seq))  # [B, S, V]
    logp_all = torch.log_softmax(logits[:, :-1].float() / tau, -1)
    lp = logp_all.gather(-1, ids[:, 1:, None])[..., 0]
    return lp, -(logp_all.exp() * logp_all).sum(-1)


def _param_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [True, False])
def test_hook_and_legacy_agree_and_equal_plain_logits(tied):
    ids = _ids()
    plain_model = tiny_gpt_model(tied=tied)
    hook_model, legacy_model = tiny_gpt_model(tied=tied), tiny_gpt_model(tied=tied)
    assert torch.equal(plain_model.embedding.word_embeddings.weight, legacy_model.embedding.word_embeddings.weight)
    hook = MegatronTrainerModel.build(hook_model, HOOK, chunk_size=5)
    legacy = MegatronTrainerModel.build(legacy_model, LEGACY, chunk_size=5)
    assert (hook.mode, legacy.mode) == (HOOK, LEGACY)

    lp_h, ent_h = hook.log_probs(ids, temperature=0.7)
    lp_l, ent_l = legacy.log_probs(ids, temperature=0.7)
    lp_p, ent_p = plain_from_logits(plain_model, ids, 0.7)
    assert lp_h.shape == (2, 11) and lp_h.dtype == torch.float32
    assert torch.equal(lp_h, lp_l) and torch.equal(ent_h, ent_l)
    assert (lp_h - lp_p).abs().max() < 1e-5 and (ent_h - ent_p).abs().max() < 1e-5

    coef = torch.linspace(-1, 1, lp_h.numel()).reshape(lp_h.shape)
    for lp, ent in ((lp_h, ent_h), (lp_l, ent_l), (lp_p, ent_p)):
        ((lp * coef).sum() + 0.3 * ent.sum()).backward()
    gh, gl, gp = (_param_grads(m) for m in (hook_model, legacy_model, plain_model))
    assert gh.keys() == gl.keys() == gp.keys()
    for name in gh:
        assert torch.equal(gh[name], gl[name]), name
        assert (gh[name] - gp[name]).abs().max() <= 1e-4 * max(1.0, float(gp[name].abs().max())), name


def test_auto_picks_hook_on_installed_megatron_and_leaves_forward_untouched():
    model = tiny_gpt_model()
    trainer = MegatronTrainerModel.build(model, AUTO)
    assert trainer.mode is HOOK and stored_mode(model) is HOOK
    assert "forward" not in vars(model) and not hasattr(model, BACKUP_ATTR)
    assert model.forward.__func__ is type(model).forward


def test_auto_picks_legacy_when_forward_lacks_hook_parameters():
    model = tiny_gpt_model(model_cls=_old_forward_class())
    plain = plain_from_logits(model, _ids(), 1.3)
    trainer = MegatronTrainerModel.build(model, AUTO)
    assert trainer.mode is LEGACY and is_patched(model)
    lp, ent = trainer.log_probs(_ids(), temperature=1.3)
    assert (lp - plain[0]).abs().max() < 1e-5 and (ent - plain[1]).abs().max() < 1e-5


def test_forced_hook_without_the_contract_fails_at_build_naming_the_version():
    model = tiny_gpt_model(model_cls=_old_forward_class())
    with pytest.raises(FusedHookUnavailable, match=r"Megatron-Core 0\.19") as err:
        build_logprob_service(model, "hook", environ={})
    assert isinstance(err.value, RuntimeError)
    assert not hasattr(model, MODE_ATTR) and not is_patched(model)


@pytest.mark.parametrize(
    ("config_value", "env", "key"),
    [("maybe", {}, "actor.fused_forward"), (None, {"VERL_FUSED_USE_OP_HOOK": "2"}, "VERL_FUSED_USE_OP_HOOK")],
)
def test_invalid_values_fail_at_build_listing_accepted_ones(config_value, env, key):
    model = tiny_gpt_model()
    with pytest.raises(FusedForwardModeError, match="accepted") as err:
        build_logprob_service(model, config_value, environ=env)
    assert err.value.key == key and isinstance(err.value, ValueError)
    assert "'legacy'" in str(err.value) and "'hook'" in str(err.value)
    assert not hasattr(model, MODE_ATTR)


def test_environment_is_read_once_at_build(monkeypatch):
    monkeypatch.setenv("VERL_FUSED_USE_OP_HOOK", "No")
    model = tiny_gpt_model()
    service = build_logprob_service(model)
    assert (service.mode, service.source) == ("legacy", "VERL_FUSED_USE_OP_HOOK")
    monkeypatch.setenv("VERL_FUSED_USE_OP_HOOK", "not-a-mode")  # re-reading it would raise
    scores = service.compute(_ids(), temperature=0.9)
    assert scores.log_probs.shape == (2, 11) and service.mode == "legacy" and is_patched(model)
    assert stored_mode(model) is LEGACY


def test_configuration_wins_over_environment():
    model = tiny_gpt_model()
    service = build_logprob_service(model, "HOOK", environ={"VERL_FUSED_USE_OP_HOOK": "0"})
    assert (service.mode, service.source) == ("hook", "actor.fused_forward")
    assert not is_patched(model)


def test_patch_and_unpatch_are_idempotent_and_restore_exactly():
    model = tiny_gpt_model()
    original = type(model).forward
    assert patch_fused_forward(model) is True
    patched = vars(model)["forward"]
    assert patch_fused_forward(model) is False and vars(model)["forward"] is patched
    assert unpatch_fused_forward(model) is True
    assert unpatch_fused_forward(model) is False
    assert "forward" not in vars(model) and BACKUP_ATTR not in vars(model)
    assert model.forward.__func__ is original
    # An instance-level forward installed by someone else comes back as the same object.
    other = types.MethodType(original, model)
    model.forward = other
    patch_fused_forward(model)
    assert vars(model)["forward"] is not other
    unpatch_fused_forward(model)
    assert vars(model)["forward"] is other


def _recording_pre_hook(model):
    seen: list[dict] = []
    model.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    return seen


def test_hook_mode_passes_context_and_never_temperature():
    hook_model, legacy_model = tiny_gpt_model(), tiny_gpt_model()
    seen_hook, seen_legacy = _recording_pre_hook(hook_model), _recording_pre_hook(legacy_model)
    MegatronTrainerModel.build(hook_model, HOOK).log_probs(_ids(), temperature=0.6)
    MegatronTrainerModel.build(legacy_model, LEGACY).log_probs(_ids(), temperature=0.6)
    (kw,) = seen_hook
    assert "temperature" not in kw
    assert callable(kw["output_processor"]) and kw["output_processor_context"] == FusedContext(0.6)
    (kw,) = seen_legacy
    assert kw["temperature"] == 0.6 and "output_processor" not in kw


def test_sequence_parallel_gather_runs_before_the_fused_computation():
    model = tiny_gpt_model(tied=False)
    seq, batch = 8, 2
    full = torch.randn(seq, batch, 32)
    labels = _ids(batch, seq)
    events: list[tuple[str, tuple[int, ...]]] = []

    def gather(shard, group):  # a 2-way sequence-parallel all-gather, seen from rank 0
        events.append(("gather", tuple(shard.shape)))
        assert torch.equal(shard, full[: seq // 2])
        return full

    config = types.SimpleNamespace(sequence_parallel=True)
    ctx = FusedContext(temperature=0.8)
    out = make_output_processor(gather=gather)(
        hidden_states=full[: seq // 2], output_layer=model.output_layer, output_weight=None,
        labels=labels, context=ctx, config=config, input_ids=None, compute_language_model_loss=None,
    )
    assert events == [("gather", (seq // 2, batch, 32))]
    logp_all = torch.log_softmax((full.transpose(0, 1) @ model.output_layer.weight.T) / 0.8, -1)
    assert out["log_probs"].shape == (batch, seq)
    assert (out["log_probs"] - logp_all.gather(-1, labels[..., None])[..., 0]).abs().max() < 1e-5
    # The legacy forward shares the same function; without the flag no gather happens.
    events.clear()
    fused_output(full, output_layer=model.output_layer, output_weight=None, labels=labels,
                 config=types.SimpleNamespace(sequence_parallel=False), context=ctx, gather=gather)
    assert events == []


def test_non_last_pipeline_stage_returns_hidden_states_in_both_modes():
    model = tiny_gpt_model(post_process=False)
    ids = _ids()
    args = (ids, torch.arange(12).expand_as(ids), causal_mask(12))
    reference = model(*args)
    assert reference.shape == (12, 2, 32)
    hook_out = model(*args, labels=ids, output_processor=make_output_processor(),
                     output_processor_context=FusedContext(0.5))
    assert torch.equal(hook_out, reference)
    patch_fused_forward(model)
    assert torch.equal(model(*args, labels=ids, temperature=0.5), reference)


def test_mode_is_stored_on_the_real_model_behind_wrappers():
    from megatron.core.transformer.module import Float16Module

    inner = tiny_gpt_model(bf16=True)
    wrapped = Float16Module(inner.config, inner)
    trainer = MegatronTrainerModel.build(wrapped, AUTO)
    assert vars(inner)[MODE_ATTR] is HOOK and MODE_ATTR not in vars(wrapped)
    lp, _ = trainer.log_probs(_ids(), temperature=1.0)
    plain_bf16 = plain_from_logits(wrapped, _ids(), 1.0)
    assert lp.dtype == torch.float32 and (lp - plain_bf16[0]).abs().max() < 1e-4

    class Vlm(torch.nn.Module):
        def __init__(self, language_model):
            super().__init__()
            self.language_model = language_model

    class DdpLike(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    lm = tiny_gpt_model(model_cls=_old_forward_class())
    outer = DdpLike(Vlm(lm))
    trainer = MegatronTrainerModel.build(outer, AUTO)
    assert trainer.mode is LEGACY and vars(lm)[MODE_ATTR] is LEGACY and is_patched(lm)
    plain = plain_from_logits(tiny_gpt_model(), _ids(), 1.0)
    lp, _ = trainer.log_probs(_ids(), temperature=1.0)
    assert (lp - plain[0]).abs().max() < 1e-5


def test_decision_is_kept_unless_a_different_mode_is_requested():
    model = tiny_gpt_model()
    assert resolve_fused_forward(model, LEGACY) is LEGACY and is_patched(model)
    assert resolve_fused_forward(model, AUTO) is LEGACY and is_patched(model)
    assert resolve_fused_forward(model, HOOK) is HOOK and not is_patched(model)
    assert "forward" not in vars(model)
    old = tiny_gpt_model(model_cls=_old_forward_class())
    assert resolve_fused_forward(old, LEGACY) is LEGACY
    with pytest.raises(FusedHookUnavailable):
        resolve_fused_forward(old, HOOK)
    assert stored_mode(old) is LEGACY and is_patched(old)  # the failed request changed nothing


def test_bad_temperature_fails_before_the_forward():
    trainer = MegatronTrainerModel.build(tiny_gpt_model(), HOOK)
    with pytest.raises(InvalidTemperature):
        trainer.log_probs(_ids(), temperature=0.0)
