"""ModelOpt QAT backend with real nvidia-modelopt on CPU.

- Every preset through ModelOpt's quantizers with exporter numerics (CPU), under both element
  rules, q/k/v and gate/up groups included: the weight quantizers compute dequantize(exported
  tensors) bit for bit, the inputs get the rollout's activation quantization, and the
  first-forward check passes; removing QAT restores the model's outputs exactly.
- ModelOpt's own FP8 block kernel computes a third order, e4m3(x * (448 / amax)) decoded with
  1 / (448 / amax) (Transformer Engine's), which is neither rule's: a literal port of it equals
  ModelOpt's values, it differs from both rules on real weights, and the first-forward check
  raises under both, naming a layer that differs.
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
from tests.codecs.matrix import real_shaped
from tests.unit.qat_models import H, TinyHf, rollout_values


def _model() -> torch.nn.Module:
    return TinyHf(linear=torch.nn.Linear)


def _quantized_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules()
            if getattr(m, "weight_quantizer", None) is not None and m.weight_quantizer.is_enabled}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("numerics", ["engine", "compressed-tensors"])
@pytest.mark.parametrize("preset", ["FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4"])
def test_modelopt_quantizers_compute_the_exported_values(preset: str, numerics: str) -> None:
    model = _model()
    plan = QuantizationPlan.from_presets(preset, None, numerics=numerics)
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
        want_x = fake_quantize_activation(plan.effective_linear_activation, x, numerics=plan.numerics)
        assert _bits_equal(q.input_quantizer(x), want_x)


def _modelopt_fp8_block_order(w: torch.Tensor) -> torch.Tensor:
    """modelopt.torch.quantization.tensor_quant._fp8_eager on 128 x 128 blocks, expression by
    expression: scale = 448.0 / amax; q = e4m3(clamp(x * scale)); value = q * (1 / scale)."""
    n, k = w.shape
    xb = w.float().reshape(n // 128, 128, k // 128, 128)
    amax = xb.abs().amax(dim=(1, 3), keepdim=True)
    safe = torch.where(amax <= 1.0 / (1 << 24), torch.ones_like(amax), amax)
    scale = 448.0 / safe
    q = (xb * scale).clamp(min=-448.0, max=448.0).to(torch.float8_e4m3fn)
    return (q.to(torch.float32) * (1 / scale)).reshape(n, k).to(w.dtype)


class _DownProj(torch.nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.model.layers[0].mlp = torch.nn.Module()
        self.model.layers[0].mlp.down_proj = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
        with torch.no_grad():
            self.model.layers[0].mlp.down_proj.weight.copy_(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.layers[0].mlp.down_proj(x)


@pytest.mark.parametrize("numerics", ["engine", "compressed-tensors"])
def test_modelopt_own_fp8_block_kernel_computes_a_third_order(numerics: str) -> None:
    w = real_shaped(256, 512, 4)
    model = _DownProj(w)
    plan = QuantizationPlan.from_presets("FP8_BLOCK", None, numerics=numerics)
    want = rollout_values(plan, [(n, p.detach()) for n, p in model.named_parameters()])["model.layers.0.mlp.down_proj.weight"]
    ModelOptQatBackend(numerics="modelopt").apply(model, plan)
    proj = model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        got = proj.weight_quantizer(proj.weight)
    assert _bits_equal(got, _modelopt_fp8_block_order(w))
    differ = int((got.view(torch.int16) != want.view(torch.int16)).sum())
    assert differ == {"engine": 3031, "compressed-tensors": 2787}[numerics]  # the figures docs/qat.md gives
    with pytest.raises(QatNumericsMismatch) as err:
        model(torch.randn(2, 512, dtype=torch.bfloat16))
    assert err.value.layer == "model.layers.0.mlp.down_proj.weight"
    assert f"{differ} of {w.numel()} elements" in str(err.value) and "448 / amax" in str(err.value)


def test_modelopt_own_fp8_block_kernel_is_checked_bit_for_bit() -> None:
    model = _model()
    plan = QuantizationPlan.from_presets("FP8_BLOCK", None)
    want = rollout_values(plan, [(n, p.detach()) for n, p in model.named_parameters()])
    ModelOptQatBackend(numerics="modelopt").apply(model, plan)
    modules = _quantized_modules(model)
    with torch.no_grad():
        differ = {f"{n}.weight" for n, m in modules.items() if not _bits_equal(m.weight_quantizer(m.weight), want[f"{n}.weight"])}
    assert differ  # the tiny model's weights tie too (36 elements)
    with pytest.raises(QatNumericsMismatch) as err:
        model(torch.randn(4, H, dtype=torch.bfloat16))
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
