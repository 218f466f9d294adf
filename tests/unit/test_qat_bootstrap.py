"""Services.trainer_side.qat: the composition root checks the QAT settings and the built model's precision."""

from __future__ import annotations

import attrs
import pytest
import torch

from adapters.qat_reference.backend import ReferenceQatBackend
from app.bootstrap import bootstrap
from domain.errors import (
    BoundaryLayersMismatch,
    ConfigError,
    QatModeMismatch,
    QatPrecisionMismatch,
    QatWithTeRecipe,
)
from domain.quant.plan import QuantizationPlan
from domain.quant.qat import QatSummary
from tests.unit.qat_models import H, TinyHf


def _config(mode: str | None = "NVFP4", **extra: object) -> dict[str, object]:
    te = extra.pop("te", {})
    return {
        "rollout": {"quantization": {"linear": "NVFP4", "moe": "NVFP4", **extra}},
        "actor": {"megatron": {"qat": {"enable": mode is not None, "mode": mode},
                               "override_transformer_config": te}},
    }


def build_qat_backend(config, *, model, **kwargs):  # type: ignore[no-untyped-def]
    return bootstrap(config).trainer_side.qat(model, **kwargs)


def test_disabled_qat_builds_nothing() -> None:
    assert build_qat_backend(_config(mode=None), model=TinyHf()) is None


def test_qat_is_applied_and_checked() -> None:
    model = TinyHf(dtype=torch.float32)
    session = build_qat_backend(_config(), model=model)
    assert session is not None and session.summary.backend == "reference"
    quantized = {p.name for p in session.summary.quantized}
    assert "model.layers.1.mlp.experts.gate_up_proj" in quantized
    assert "model.layers.0.self_attn.q_proj.weight" in quantized and "lm_head.weight" not in quantized
    before = model(torch.ones(2, H))
    session.refresh()
    session.remove()
    assert not torch.equal(model(torch.ones(2, H)), before)


def test_wrong_mode_and_te_recipe_fail_by_key() -> None:
    with pytest.raises(QatModeMismatch, match=r"qat\.mode='MXFP4'"):
        build_qat_backend(_config("MXFP4"), model=TinyHf())
    with pytest.raises(QatWithTeRecipe):
        build_qat_backend(_config(te={"fp8": "e4m3"}), model=TinyHf())
    with pytest.raises(ConfigError, match=r"qat backend"):
        build_qat_backend(_config(), model=TinyHf(), backend="nope")


def test_first_last_bf16_layers_must_match_the_rollout_ignore_list() -> None:
    te = {"first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 1, "num_layers_at_end_in_bf16": 0}
    with pytest.raises(BoundaryLayersMismatch, match=r"keeps layers \[0\]"):
        build_qat_backend(_config(te=te), model=TinyHf())
    session = build_qat_backend(_config(te=te, ignore=[r"re:.*layers\.0\..*"]), model=TinyHf())
    assert session is not None
    precision = {p.name: p for p in session.summary.precision}
    assert precision["model.layers.0.self_attn.q_proj.weight"].weight == "BF16"
    assert precision["model.layers.1.self_attn.q_proj.weight"].weight == "NVFP4"


@attrs.define
class SkipsOProj:
    """A QatBackend that leaves o_proj in BF16: what a misconfigured backend would build."""

    inner: ReferenceQatBackend = attrs.field(factory=ReferenceQatBackend)
    name: str = "skips-o-proj"

    def apply(self, model: torch.nn.Module, plan: QuantizationPlan) -> QatSummary:
        return self.inner.apply(model, attrs.evolve(plan, ignore=(*plan.ignore, "o_proj")))

    def refresh(self, model: torch.nn.Module) -> None:
        self.inner.refresh(model)

    def remove(self, model: torch.nn.Module) -> None:
        self.inner.remove(model)

    def effective_precision(self, model: torch.nn.Module):  # type: ignore[no-untyped-def]
        return self.inner.effective_precision(model)


def test_effective_precision_mismatch_is_reported_and_qat_removed() -> None:
    model = TinyHf(dtype=torch.float32)
    x = torch.ones(2, H)
    before = model(x)
    with pytest.raises(QatPrecisionMismatch) as err:
        build_qat_backend(_config(), model=model, qat_backend=SkipsOProj())
    assert {n for n, _, _ in err.value.layers} == {f"model.layers.{i}.self_attn.o_proj.weight" for i in (0, 1)}
    assert "rollout weights NVFP4" in str(err.value) and "training weights BF16" in str(err.value)
    assert torch.equal(model(x), before)
