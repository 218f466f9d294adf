"""QAT consistency checks (settings vs rollout plan, effective precision) and the backend's lifecycle."""

from __future__ import annotations

import pytest
import torch

from adapters.qat_reference.backend import ReferenceQatBackend
from domain.errors import (
    BoundaryLayersMismatch,
    FusedGroupSplit,
    QatModeMismatch,
    QatPrecisionMismatch,
    QatStateError,
    QatWithTeRecipe,
    RefitError,
)
from domain.quant.plan import QuantizationPlan
from domain.quant.qat import HfPart, LayerPrecision, TrainerTensor
from domain.quant.qat_checks import (
    QatSettings,
    check_effective_precision,
    check_qat_plan,
    expected_precision,
    tensor_precision,
)
from tests.unit.qat_models import H, TinyHf


def _shapes(layers: int = 4) -> list[tuple[str, tuple[int, ...]]]:
    out = [("model.embed_tokens.weight", (128, 64))]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", (64,)), (f"{p}.self_attn.q_proj.weight", (64, 64)),
                (f"{p}.self_attn.k_proj.weight", (32, 64)), (f"{p}.self_attn.v_proj.weight", (32, 64)),
                (f"{p}.self_attn.o_proj.weight", (64, 64)), (f"{p}.mlp.down_proj.weight", (64, 64))]
    return [*out, ("lm_head.weight", (128, 64))]


def test_qat_mode_must_be_the_rollouts_preset() -> None:
    plan = QuantizationPlan.from_presets("NVFP4", None)
    with pytest.raises(QatModeMismatch, match=r"qat\.mode='MXFP4'.*NVFP4"):
        check_qat_plan(plan, _shapes(), QatSettings(mode="MXFP4"))
    assert check_qat_plan(plan, _shapes(), QatSettings(mode="nvfp4")) == plan


def test_qat_with_a_transformer_engine_recipe_is_rejected() -> None:
    plan = QuantizationPlan.from_presets("FP8_BLOCK", None)
    with pytest.raises(QatWithTeRecipe, match=r"override_transformer_config\.fp8"):
        check_qat_plan(plan, _shapes(), QatSettings(mode="FP8_BLOCK", te_fp8="e4m3"))


def test_bf16_boundary_layers_must_be_bf16_in_the_rollout_and_the_error_lists_them() -> None:
    settings = QatSettings(mode="NVFP4", first_last_layers_bf16=True, num_layers_at_start_in_bf16=1,
                           num_layers_at_end_in_bf16=2)
    plan = QuantizationPlan.from_presets("NVFP4", None, ignore=[r"re:.*layers\.0\..*"])
    with pytest.raises(BoundaryLayersMismatch) as err:
        check_qat_plan(plan, _shapes(4), settings)
    assert "keeps layers [0, 2, 3] in BF16" in str(err.value)
    assert "rollout quantizes layers [2, 3]" in str(err.value)
    assert repr(r"re:.*layers\.(0|2|3)\..*") in str(err.value)
    agreed = QuantizationPlan.from_presets("NVFP4", None, ignore=[r"re:.*layers\.(0|2|3)\..*"])
    qat_plan = check_qat_plan(agreed, _shapes(4), settings)
    for name, shape in _shapes(4):
        assert qat_plan.decide(name, shape).format == agreed.decide(name, shape).format


def test_qat_ignore_patterns_must_be_ignored_by_the_rollout_too() -> None:
    plan = QuantizationPlan.from_presets("MXFP8", None)
    with pytest.raises(QatModeMismatch, match=r"\*o_proj"):
        check_qat_plan(plan, _shapes(), QatSettings(mode="MXFP8", ignore=("*o_proj",)))


def test_effective_precision_lists_every_difference_both_ways() -> None:
    plan = QuantizationPlan.from_presets("FP8_BLOCK", None)
    t = [TrainerTensor(n, s, (HfPart(n, s),)) for n, s in _shapes(1)]
    expected = expected_precision(plan, t)
    assert expected["model.layers.0.self_attn.o_proj.weight"] == LayerPrecision(
        "model.layers.0.self_attn.o_proj.weight", "FP8_BLOCK", "fp8_per_token_group_128")
    assert expected["lm_head.weight"] == LayerPrecision("lm_head.weight")
    assert "model.embed_tokens.weight" not in expected and "model.layers.0.input_layernorm.weight" not in expected
    actual = dict(expected)
    actual["model.layers.0.self_attn.o_proj.weight"] = LayerPrecision("model.layers.0.self_attn.o_proj.weight")
    actual["lm_head.weight"] = LayerPrecision("lm_head.weight", "FP8_BLOCK", "none")
    with pytest.raises(QatPrecisionMismatch) as err:
        check_effective_precision(plan, t, actual)
    layers = {name for name, _, _ in err.value.layers}
    assert layers == {"model.layers.0.self_attn.o_proj.weight", "lm_head.weight"}
    check_effective_precision(plan, t, expected)


def test_a_trainer_tensor_whose_parts_differ_in_format_is_rejected() -> None:
    plan = QuantizationPlan.from_presets("NVFP4", None, ignore=["q_proj"])
    parts = [HfPart(f"model.layers.0.self_attn.{p}_proj.weight", (32, 64), (slice(32 * i, 32 * i + 32),))
             for i, p in enumerate("qkv")]
    with pytest.raises(FusedGroupSplit, match="linear_qkv"):
        tensor_precision(plan, TrainerTensor("decoder.layers.0.self_attention.linear_qkv.weight", (96, 64), parts))


def test_lifecycle_apply_refresh_remove() -> None:
    model = TinyHf(dtype=torch.float32)
    x = torch.randn(3, H)
    before = model(x)
    backend = ReferenceQatBackend()
    with pytest.raises(QatStateError):
        backend.refresh(model)
    plan = QuantizationPlan.from_presets("MXFP4", "NVFP4")
    summary = backend.apply(model, plan)
    with pytest.raises(QatStateError):
        backend.apply(model, plan)
    during = model(x)
    assert not torch.equal(during, before)
    eff = backend.effective_precision(model)
    check_effective_precision(plan, summary.tensors, eff)
    backend.refresh(model)
    backend.remove(model)
    assert torch.equal(model(x), before)
    backend.remove(model)  # no-op
    with pytest.raises(QatStateError):
        backend.effective_precision(model)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_parameters_are_restored_when_the_forward_fails() -> None:
    model = TinyHf(dtype=torch.float32)
    ReferenceQatBackend().apply(model, QuantizationPlan.from_presets("FP8_BLOCK", None))
    with pytest.raises(RuntimeError):
        model.model.layers[0].self_attn.q_proj(torch.randn(3, H + 1))
    assert isinstance(model.model.layers[0].self_attn.q_proj._parameters["weight"], torch.nn.Parameter)


def test_training_updates_are_seen_by_the_next_forward() -> None:
    model = TinyHf(dtype=torch.float32)
    plan = QuantizationPlan.from_presets("NVFP4", None)
    ReferenceQatBackend().apply(model, plan)
    proj = model.model.layers[0].self_attn.o_proj
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(3, H)).square().sum().backward()
    opt.step()
    with torch.no_grad():  # an update that bypasses the version counter, as Megatron's copies do
        proj.weight.data.mul_(1.5)
    model(torch.randn(3, H))
    from tests.unit.qat_models import rollout_values

    want = rollout_values(plan, [("model.layers.0.self_attn.o_proj.weight", proj.weight.detach())])
    assert torch.equal(proj.seen_weight, want["model.layers.0.self_attn.o_proj.weight"])


def test_errors_are_refit_errors_with_builtin_bases() -> None:
    assert issubclass(QatPrecisionMismatch, RefitError) and issubclass(QatPrecisionMismatch, ValueError)
    assert issubclass(QatStateError, RuntimeError)
