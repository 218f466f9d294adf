"""pytest wrapper of check_gdn_fla.py: fla's varlen GDN kernels == per-sequence reference on CUDA."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_fla_kernels_on_a_packed_batch_match_the_per_sequence_reference() -> None:
    pytest.importorskip("fla", reason="needs flash-linear-attention (the `fla` extra)")
    from tests.gpu.check_gdn_fla import run_checks

    results = run_checks(quick=True)
    failed = [r.line() for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    forward = [r for r in results if r.name.endswith(" fwd")]
    assert forward
    for r in forward:
        # Ignoring the boundaries would cost far more than the kernels' rounding.
        assert not math.isnan(r.leak) and r.leak > 10 * r.max_abs_diff, r.line()
