"""The refit shapes suite on a real vLLM engine, colocated and as the server rl-refit starts: the
fault table of tests/integration/test_refit_shapes.py, with each restore, gives the outcomes and
engine states of the single-process and distributed refits of the reference engine (a server's
workers keep a backup, and settle as a transactional engine that undoes a refused commit).

vLLM commits layer by layer (PER_LAYER), with no verification step before a layer is written,
so the table's `verify` point does not apply to it: the points are the engine's begin, a bucket,
finalize, the storage check after the commit and the post-refit probe. A replay restores vLLM's
previous weights (by re-streaming the previous refit's buckets through its layerwise reload); the
digests of every parameter and buffer then equal those before the failed refit. After every fault
the engine is compared with a cold start of the same export.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.services.transaction import Restore
from domain.refit.report import RefitOutcome
from domain.refit.session import CommitMode
from domain.refit.status import EngineState
from tests.integration.test_refit_shapes import expected
from tests.vllm.test_real_engine import _by_name, _equal, scenario


def _settles_to(point: str, deployment: str, restore: Restore) -> tuple[Any, Any]:
    """The fault table's outcome for the engine's behaviour: in-process vLLM workers commit layer by
    layer and keep nothing (PER_LAYER); a server's workers keep the last live refit's buckets, so a
    failure before the commit leaves its weights as they were (as a transactional engine's), and a
    committed refit the trainer refuses is undone from that backup."""
    if deployment == "colocated":
        return expected(point, CommitMode.PER_LAYER, restore)
    if point in ("storage", "probe"):
        return RefitOutcome.ROLLED_BACK, EngineState.RESTORED
    return expected(point, CommitMode.TRANSACTIONAL, restore)


@pytest.mark.slow
# a server's settling (a failure before the commit keeps its weights, a refused commit is undone) is
# shown on the real engine by test_real_engine's faults and guards; the table of every restore here
@pytest.mark.parametrize("deployment", ["colocated"])
def test_a_real_engine_fails_like_every_other_shape(cold_cache: Path, deployment: str) -> None:
    result = scenario(cold_cache, "FP8_BLOCK-experts", scenario="shapes", deployment=deployment)
    rows = result["shapes"]
    assert len(rows) == 10
    for row in rows:
        outcome, state = _settles_to(row["point"], deployment, Restore(row["restore"]))
        where = f"{row['restore']} {row['point']}: {row}"
        assert row["first_ok"], where
        assert row["outcome"] == outcome.value and row["engine_state"] == state.value, where
        assert row["serves_previous"] == (state.value != "stale"), where
        assert row["refuses"] == (state.value == "stale"), where
        assert row["recovered"], where
    _equal(_by_name(result)["after every fault"])
