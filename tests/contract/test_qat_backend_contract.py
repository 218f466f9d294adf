"""Contract of the QatBackend port, run against the reference (pure torch) backend and the ModelOpt
backend (real nvidia-modelopt; its FP8 block fake-quant runs on CPU, the other formats need CUDA).

After `apply(model, plan)` every Linear the plan quantizes computes with weights bit-identical to
dequantize(exported tensors); the summary and `effective_precision` say what was installed;
gradients pass straight through; `refresh` before `apply` and a second `apply` raise
QatStateError; `remove` restores the model's own outputs exactly (a second `remove` is a no-op,
`effective_precision` raises until the next `apply`).
"""

from __future__ import annotations

import pytest
import torch

from domain.errors import QatStateError
from domain.quant.plan import QuantizationPlan
from tests.unit.qat_models import H, RecLinear, TinyHf, rollout_values

BACKENDS = ("reference", "modelopt")
PLAN = QuantizationPlan.from_presets("FP8_BLOCK", None)  # what both backends run on CPU


def _backend(kind: str):  # type: ignore[no-untyped-def]
    if kind == "reference":
        from adapters.qat_reference.backend import ReferenceQatBackend

        return ReferenceQatBackend()
    pytest.importorskip("modelopt.torch.quantization", reason="needs nvidia-modelopt (the `modelopt` extra)")
    from adapters.modelopt.backend import ModelOptQatBackend

    return ModelOptQatBackend()


def _model(kind: str) -> TinyHf:
    # ModelOpt converts plain nn.Linear modules; the reference backend works on any Linear.
    return TinyHf(linear=torch.nn.Linear if kind == "modelopt" else RecLinear)


def _linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def _effective_weight(model: torch.nn.Module, name: str, module: torch.nn.Module) -> torch.Tensor:
    """The weight the module's forward computes with: the response to unit inputs."""
    x = torch.eye(module.in_features, dtype=module.weight.dtype)
    with torch.no_grad():
        return module(x).T.contiguous()


@pytest.fixture(params=BACKENDS)
def kind(request) -> str:  # type: ignore[no-untyped-def]
    return request.param


def test_quantized_linears_compute_the_exported_values_bit_for_bit(kind: str) -> None:
    model = _model(kind)
    want = rollout_values(PLAN, [(n, p.detach()) for n, p in model.named_parameters()])
    backend = _backend(kind)
    summary = backend.apply(model, PLAN)
    assert summary.backend == backend.name and summary.quantized
    model(torch.randn(2, H, dtype=torch.bfloat16))  # a first forward (ModelOpt checks itself in it)
    precision = backend.effective_precision(model)
    for name, module in _linears(model).items():
        d = PLAN.decide(f"{name}.weight", tuple(module.weight.shape))
        eff = precision[f"{name}.weight"]
        assert eff.weight == d.format.name, name
        if d.is_quantized:
            got = _effective_weight(model, name, module)
            ref = want[f"{name}.weight"]
            # FP8 1x128 activation groups of the identity rows are exact, so the response is the weight.
            assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), name


def test_gradients_pass_straight_through(kind: str) -> None:
    model = _model(kind)
    backend = _backend(kind)
    backend.apply(model, PLAN)
    q = model.model.layers[0].self_attn.q_proj
    x = torch.randn(3, H, dtype=torch.bfloat16, requires_grad=True)
    q(x).float().sum().backward()
    assert q.weight.grad is not None and bool(torch.isfinite(q.weight.grad.float()).all())
    assert float(q.weight.grad.float().abs().sum()) > 0 and x.grad is not None


def test_state_errors_and_remove_restores_the_model(kind: str) -> None:
    model = _model(kind)
    x = torch.randn(4, H, dtype=torch.bfloat16)
    with torch.no_grad():
        before = model(x)
    backend = _backend(kind)
    with pytest.raises(QatStateError):
        backend.refresh(model)
    backend.apply(model, PLAN)
    with torch.no_grad():
        assert not torch.equal(model(x), before)  # FP8 blocks change the outputs
    with pytest.raises(QatStateError):
        backend.apply(model, PLAN)
    backend.refresh(model)
    backend.remove(model)
    backend.remove(model)  # a second remove is a no-op
    with torch.no_grad():
        assert torch.equal(model(x), before)
    with pytest.raises(QatStateError):  # removed: the backend holds nothing for the model any more
        backend.effective_precision(model)
    backend.apply(model, PLAN)  # and it can be applied again
    with torch.no_grad():
        assert not torch.equal(model(x), before)
