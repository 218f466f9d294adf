"""A hung peer ends in a timeout error naming the rank and the step, never in a hang.

World: one trainer (rank 0) and two engines (ranks 1, 2) over gloo on 127.0.0.1. One good refit
runs under generous bounds (support.GENEROUS_S); then the bounds are made short (step 1.5 s, phase
2.5 s: TorchDistCollectives.bound) and a rank hangs (sleeps 30 s, support.HANG_S) in the next
refit: its peers must raise CollectiveTimeout (or PeerLost, once a timed-out peer has exited) long
before the hang ends, and every engine must still hold the previous refit's weights and serve
them. The verdicts do not depend on the machine's load: nothing but the hung refit runs under the
short bounds, the hang is 20 times them, and the only time checked is that the peers did not wait
it out.
"""

from __future__ import annotations

import re

import pytest

from adapters.distributed.launch import launch_world
from adapters.memory.faults import RankFault
from tests.distributed import support

pytestmark = pytest.mark.distributed
STEP_S, PHASE_S = 1.5, 2.5


def _world(fault: RankFault) -> list[dict]:
    results = launch_world(support.hang_rank, 3, ({}, 2, fault, STEP_S, PHASE_S), timeout_s=support.HANG_S + 120)
    failed = [f"rank {r.rank}: {r.error}\n{r.traceback or ''}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    return [r.value for r in results]


def test_hung_source_times_out_its_engines() -> None:
    results = _world(RankFault(0, "bucket", 1, hang=True, refit=1))
    for rank in (1, 2):
        got = results[rank]
        assert got["type"] == "CollectiveTimeout", got
        # the second refit: the layout is known, so bucket 1 is one message (or lead and data)
        assert got["rank"] == rank and re.fullmatch(r"bucket 1( lead)?", got["step"]), got
        assert f"rank {rank}: timed out after {STEP_S:g} s" in got["text"]
        assert got["seconds"] < support.HANG_S, got  # bounded by the timeout, not the hang
        assert got["report"], "the error carries this rank's report"
        assert got["kept"] and got["busy"] is False, "the engine keeps and serves its previous weights"
    assert results[0]["type"] is not None  # the hung rank fails too once it wakes up


def test_hung_engine_times_out_the_agreement() -> None:
    results = _world(RankFault(2, "finalize", hang=True, refit=1))
    for rank in (0, 1):
        got = results[rank]
        assert got["type"] in ("CollectiveTimeout", "PeerLost"), got
        assert got["step"] == "agreement: finalized" or "agreement: finalized" in got["text"], got
        assert got["seconds"] < support.HANG_S, got
    # Engine 1 had committed when the agreement timed out: it replayed the previous refit.
    assert results[1]["kept"] and results[1]["busy"] is False
