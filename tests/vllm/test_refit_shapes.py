"""The refit shapes suite on a real vLLM engine, colocated and in processes of its own: the fault
table of tests/integration/test_refit_shapes.py, with each restore, gives the same outcomes and
engine states as the single-process and distributed refits of the reference engine.

vLLM commits layer by layer (PER_LAYER), with no verification step before a layer is written,
so the table's `verify` point does not apply to it: the points are the engine's begin, a bucket,
finalize, the storage check after the commit and the post-refit probe. A replay restores vLLM's
previous weights (by re-streaming the previous refit's buckets through its layerwise reload); the
digests of every parameter and buffer then equal those before the failed refit. After every fault
the engine is compared with a cold start of the same export.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from app.services.transaction import Restore
from domain.refit.session import CommitMode
from tests.integration.test_refit_shapes import expected
from tests.vllm.test_real_engine import _by_name, _equal, scenario


@pytest.mark.slow
@pytest.mark.parametrize("deployment", ["colocated", "disaggregated"])
def test_a_real_engine_fails_like_every_other_shape(cold_cache: Path, deployment: str) -> None:
    result = scenario(cold_cache, "FP8_BLOCK-experts", scenario="shapes", deployment=deployment)
    rows = result["shapes"]
    assert len(rows) == 10
    for row in rows:
        outcome, state = expected(row["point"], CommitMode.PER_LAYER, Restore(row["restore"]))
        where = f"{row['restore']} {row['point']}: {row}"
        assert row["first_ok"], where
        assert row["outcome"] == outcome.value and row["engine_state"] == state.value, where
        assert row["serves_previous"] == (state.value != "stale"), where
        assert row["refuses"] == (state.value == "stale"), where
        assert row["recovered"], where
    _equal(_by_name(result)["after every fault"])
