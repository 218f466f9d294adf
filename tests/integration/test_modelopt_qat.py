"""ModelOpt QAT backend with real nvidia-modelopt on CPU.

- FP8 block: the weight quantizers ModelOpt inserts compute dequantize(exported tensors) bit for
  bit (exporter numerics), the inputs get the rollout's FP8 1x128 per-token groups, and the
  first-forward check passes; with ModelOpt's own FP8 kernel the check raises exactly when
  ModelOpt's values differ from the exporter's (verified independently here), naming the layer.
- Every preset through ModelOpt's quantizers with exporter numerics (CPU), q/k/v and gate/up
  groups included; removing QAT restores the model's outputs exactly.
The MX and NVFP4 kernels of ModelOpt itself need CUDA: tests/gpu/check_modelopt_qat.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("modelopt.torch.quantization", reason="needs nvidia-modelopt (the `modelopt` extra)")

from adapters.modelopt.backend import ModelOptQatBackend
from domain.errors import QatNumericsMismatch, QatUnsupportedModel
from domain.quant.codecs import fake_quantize_activation
from domain.quant.formats import ActivationScheme
from domain.quant.plan import QuantizationPlan
from domain.quant.qat_checks import check_effective_precision
from tests.unit.qat_models import H, TinyHf, rollout_values


def _model() -> torch.nn.Module:
    return TinyHf(linear=torch.nn.Linear)


def _quantized_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules()
            if getattr(m, "weight_quantizer", None) is not None and m.weight_quantizer.is_enabled}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("preset", ["FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4"])
def test_modelopt_quantizers_compute_the_exported_values(preset: str) -> None:
    model = _model()
    plan = QuantizationPlan.from_presets(preset, None)
    want = rollout_values(plan, [(n, p.detach()) for n, p in model.named_parameters()])
    backend = ModelOptQatBackend()
    summary = backend.apply(model, plan)
    check_effective_precision(plan, summary.tensors, backend.effective_precision(model))
    modules = _quantized_modules(model)
    assert len(modules) == 11  # every q/k/v/o and gate/up/down; not the router, not lm_head
    x = torch.randn(4, H, dtype=torch.bfloat16)
    model(x)  # the first-forward check passes
    with torch.no_grad():
        for name, m in modules.items():
            assert _bits_equal(m.weight_quantizer(m.weight), want[f"{name}.weight"]), name
        q = modules["model.layers.0.self_attn.q_proj"]
        assert _bits_equal(q.input_quantizer(x), fake_quantize_activation(plan.effective_linear_activation, x))


def test_modelopt_own_fp8_block_kernel_is_checked_bit_for_bit() -> None:
    model = _model()
    plan = QuantizationPlan.from_presets("FP8_BLOCK", None)
    want = rollout_values(plan, [(n, p.detach()) for n, p in model.named_parameters()])
    ModelOptQatBackend(numerics="modelopt").apply(model, plan)
    modules = _quantized_modules(model)
    with torch.no_grad():
        differ = {f"{n}.weight" for n, m in modules.items() if not _bits_equal(m.weight_quantizer(m.weight), want[f"{n}.weight"])}
    x = torch.randn(4, H, dtype=torch.bfloat16)
    if not differ:
        model(x)
        return
    with pytest.raises(QatNumericsMismatch) as err:
        model(x)
    assert err.value.layer in differ
    assert "elements" in str(err.value) and "numerics='exporter'" in str(err.value)


def test_remove_restores_the_unquantized_outputs() -> None:
    model = _model()
    x = torch.randn(4, H, dtype=torch.bfloat16)
    with torch.no_grad():
        before = model(x)
    backend = ModelOptQatBackend()
    backend.apply(model, QuantizationPlan.from_presets("NVFP4", None))
    with torch.no_grad():
        during = model(x)
    backend.remove(model)
    with torch.no_grad():
        after = model(x)
    assert not torch.equal(during, before)
    assert torch.equal(after, before)


def test_gradients_pass_straight_through_modelopt_quantizers() -> None:
    model = TinyHf(dtype=torch.float32, linear=torch.nn.Linear)
    proj = model.model.layers[0].mlp.down_proj
    ModelOptQatBackend().apply(model, QuantizationPlan.from_presets("MXFP4", None))
    x = torch.randn(3, 64, requires_grad=True)
    g = torch.randn(3, H)
    (proj(x) * g).sum().backward()
    with torch.no_grad():
        xq = fake_quantize_activation(ActivationScheme.MXFP4, x)
        wq = proj.weight_quantizer(proj.weight)
    assert torch.equal(proj.weight.grad, g.t() @ xq)
    assert torch.equal(x.grad, g @ wq)


def test_unsupported_settings_fail_at_apply_with_the_reason() -> None:
    with pytest.raises(QatUnsupportedModel, match="gate_up_proj"):
        ModelOptQatBackend().apply(_model(), QuantizationPlan.from_presets(None, "NVFP4"))
    with pytest.raises(QatUnsupportedModel, match="CUDA"):
        ModelOptQatBackend(numerics="modelopt").apply(_model(), QuantizationPlan.from_presets("MXFP8", None))


def test_modules_modelopt_does_not_convert_are_reported() -> None:
    model = TinyHf()  # its Linear subclass is not a class ModelOpt converts
    with pytest.raises(QatUnsupportedModel, match="reference QAT backend"):
        ModelOptQatBackend().apply(model, QuantizationPlan.from_presets("FP8_BLOCK", None))
