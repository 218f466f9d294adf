"""The reference engine stages retained buckets by reference: the same live bits as copying, less
staging memory, one copy per byte, and the transactional guarantees unchanged."""

from __future__ import annotations

import attrs
import pytest
import torch

from adapters.reference.config import MICRO_MOE
from adapters.reference.engine import ReferenceEngine
from domain.errors import RefitVerificationFailed
from domain.quant.plan import QuantizationPlan
from tests import refit_support as rs
from tests.refit_support import one_thread  # noqa: F401  (autouse fixture)

PLANS = {"bf16": QuantizationPlan.bf16(), "fp8-nvfp4": rs.DEFAULT_PLAN}


def _retained(buckets):
    return [attrs.evolve(b, retained=True) for b in buckets]


@pytest.mark.parametrize("mode", ["transactional", "per-layer"])
@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS.keys())
def test_retained_buckets_commit_the_same_bits_as_copied_ones(plan, mode):
    stream = rs.stream(rs.trainer(3), plan)
    copied, by_ref = (ReferenceEngine(MICRO_MOE, plan, commit_mode=mode) for _ in range(2))
    rs.full_refit(copied, rs.buckets(stream))
    result = rs.full_refit(by_ref, _retained(rs.buckets(stream)))
    assert rs.same_bits(rs.bits(by_ref.live_weights()), rs.bits(copied.live_weights()))
    # BF16 needs no staging at all; quantized plans stage only the fused global scales.
    full = rs.full_refit(ReferenceEngine(MICRO_MOE, plan, commit_mode=mode), rs.buckets(stream))
    assert result.peak_staging_bytes < full.peak_staging_bytes
    if not plan.is_quantized:
        assert result.peak_staging_bytes == 0


def test_live_weights_do_not_alias_the_retained_buffers():
    plan = QuantizationPlan.bf16()
    engine = ReferenceEngine(MICRO_MOE, plan)
    buckets = _retained(rs.buckets(rs.stream(rs.trainer(1), plan)))
    rs.full_refit(engine, buckets)
    before = rs.bits(engine.live_weights())
    for b in buckets:  # the transport reuses the buffers for the next refit
        b.buffer.fill_(0x7F)
    assert rs.same_bits(rs.bits(engine.live_weights()), before)


def test_a_later_bucket_that_is_not_retained_is_copied_with_the_earlier_views():
    plan = QuantizationPlan.bf16()
    stream = rs.stream(rs.trainer(2), plan)
    reference = ReferenceEngine(MICRO_MOE, plan)
    rs.full_refit(reference, rs.buckets(stream))
    buckets = rs.buckets(stream)
    mixed = [attrs.evolve(b, retained=i % 2 == 0) for i, b in enumerate(buckets)]
    engine = ReferenceEngine(MICRO_MOE, plan)
    engine.begin_refit(1)
    for b in mixed:
        engine.load_bucket(b)
        if not b.retained:
            b.buffer.fill_(0x55)  # a buffer that is not retained may be reused at once
    engine.finalize_refit()
    assert rs.same_bits(rs.bits(engine.live_weights()), rs.bits(reference.live_weights()))


def test_a_nan_in_a_retained_bucket_fails_verification_and_keeps_the_live_weights():
    plan = QuantizationPlan.bf16()
    engine = ReferenceEngine(MICRO_MOE, plan)
    rs.full_refit(engine, rs.buckets(rs.stream(rs.trainer(0), plan)))
    before = rs.bits(engine.live_weights())
    stream = rs.stream(rs.trainer(4), plan)
    name, t = stream[3]
    bad = t.clone()
    bad.view(-1)[0] = float("nan")
    stream[3] = (name, bad)
    with pytest.raises(RefitVerificationFailed, match="NaN or Inf"):
        rs.full_refit(engine, _retained(rs.buckets(stream)), refit_id=2)
    assert rs.same_bits(rs.bits(engine.live_weights()), before) and not engine.is_stale


def test_engines_with_verifiers_copy_so_that_verifiers_see_whole_tensors():
    seen: list[type] = []
    plan = QuantizationPlan.bf16()
    engine = ReferenceEngine(MICRO_MOE, plan, verifiers=[lambda _g, flat: seen.extend(type(t) for t in flat.values())])
    result = rs.full_refit(engine, _retained(rs.buckets(rs.stream(rs.trainer(0), plan))))
    assert seen and set(seen) == {torch.Tensor}
    assert result.peak_staging_bytes > 0
