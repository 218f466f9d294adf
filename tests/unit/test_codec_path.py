"""The refit's codec path: chosen once, before the first refit, the compiled path only where its
bytes equal the eager reference's on every tensor of the model; the report says which path ran.

The compiled kernels are replaced here by the same kernel functions run eagerly with the fast
encoders (no compiler needed, so the choice's logic is tested in seconds);
tests/codecs/test_fast_path.py compiles them for real."""

from __future__ import annotations

import pytest
import torch

import tests.refit_support as rs
from adapters.reference.config import MICRO_MOE
from adapters.reference.engine import ReferenceEngine
from app.services import codec_path
from app.services.codec_path import choose_codec_path
from app.services.refit import RefitService
from domain.quant.codecs import compile as kernels
from domain.quant.codecs.compile import CodecPath
from domain.quant.formats import MXFP4
from domain.quant.plan import QuantizationPlan

MXFP4_PLAN = QuantizationPlan.from_presets(MXFP4.name, MXFP4.name)


def _uncompiled(fn):
    return fn  # the kernel itself: called with fast=True, eagerly


def _corrupting(fn):
    def kernel(*args):
        elements, scale, amax = fn(*args)
        return elements ^ 1 if elements.dtype == torch.uint8 else elements, scale, amax
    return kernel


def _failing(fn):
    def kernel(*args):
        raise RuntimeError("no C++ compiler")
    return kernel


def test_bf16_and_small_models_stay_eager_untried(monkeypatch) -> None:
    monkeypatch.setattr(kernels, "_compiled", _failing)  # trying it would fail the choice
    trainer = rs.trainer()
    bf16 = choose_codec_path(QuantizationPlan.bf16(), trainer)
    assert bf16.path is CodecPath.EAGER and "BF16" in bf16.reason
    small = choose_codec_path(MXFP4_PLAN, trainer)
    assert small.path is CodecPath.EAGER and "compiling would cost more" in small.reason
    assert small.warmup_seconds == 0.0
    assert choose_codec_path(MXFP4_PLAN, trainer, "eager", min_bytes=0).reason == "eager by request"
    with pytest.raises(ValueError, match="auto, eager"):
        choose_codec_path(MXFP4_PLAN, trainer, "fast")


def test_identical_bytes_are_required_and_compared_on_every_tensor(monkeypatch) -> None:
    monkeypatch.setattr(kernels, "_compiled", _uncompiled)
    same = choose_codec_path(MXFP4_PLAN, rs.trainer(), min_bytes=0)
    assert "bit-identical to eager on every tensor" in same.reason
    assert same.eager_seconds > 0 and same.compiled_seconds > 0
    monkeypatch.setattr(kernels, "_compiled", _corrupting)
    differs = choose_codec_path(MXFP4_PLAN, rs.trainer(), min_bytes=0)
    assert differs.path is CodecPath.EAGER
    assert "bytes differ from eager's in" in differs.reason and "weight_packed" in differs.reason


def test_a_failing_compiler_leaves_the_eager_path(monkeypatch) -> None:
    monkeypatch.setattr(kernels, "_compiled", _failing)
    choice = choose_codec_path(MXFP4_PLAN, rs.trainer(), min_bytes=0)
    assert choice.path is CodecPath.EAGER
    assert "the compiled path failed (RuntimeError: no C++ compiler" in choice.reason


def test_the_refit_report_says_which_path_ran_and_the_engine_gets_the_same_bytes(monkeypatch) -> None:
    monkeypatch.setattr(kernels, "_compiled", _uncompiled)
    monkeypatch.setattr(codec_path, "AUTO_MIN_BYTES", 0)
    reports = {}
    weights = {}
    for policy in ("auto", "eager"):
        engine = ReferenceEngine(MICRO_MOE, MXFP4_PLAN)
        svc = RefitService(rs.trainer(), engine, MXFP4_PLAN, bucket_bytes=rs.SMALL_BUCKET, codec_path=policy)
        reports[policy] = svc.refit()
        weights[policy] = rs.bits(engine.live_weights())
    assert reports["eager"].codec_path == "eager"
    chosen = reports["auto"].codec_path
    assert chosen in ("compiled", "eager")  # compiled unless the fast kernels ran slower here
    assert reports["auto"].log_fields()["codec_path"] == chosen
    assert rs.same_bits(weights["auto"], weights["eager"])
