"""A failure injected on any rank, at any step, aborts the same refit on every rank, with nothing lost.

Each world (4 processes over gloo on 127.0.0.1) runs, per injected fault, three refits: step 0
succeeds, step 1 fails as scripted, step 2 succeeds. Every rank must raise the same
DistributedRefitFailed for step 1 naming the faulty rank and step; every transactional engine
must then serve step 0's weights bit for bit (kept, or restored by replaying step 0's buckets);
and step 2 must be bit-identical to the single-process refit.
"""

from __future__ import annotations

import pytest

from adapters.distributed.launch import launch_world
from adapters.memory.faults import RankFault
from tests.distributed import support

pytestmark = pytest.mark.distributed
PRESETS = ("FP8_BLOCK", "NVFP4")

# tp=2 (ranks 0 = source, 1 = TP peer) + engines 2 and 3.
TP_FAULTS = [
    RankFault(0, "begin", refit=1),
    RankFault(0, "export", 2, refit=1),  # the source, on a TP-split unit
    RankFault(0, "export", 1, refit=1),  # the source, on a unit it holds alone (a norm)
    RankFault(0, "bucket", 1, refit=1),  # the source's transport
    RankFault(0, "finalize", refit=1),  # a trainer fails while the engines commit: they replay
    RankFault(1, "begin", refit=1),
    RankFault(1, "export", 0, refit=1),  # the TP peer
    RankFault(1, "verify", refit=1),
    RankFault(2, "begin", refit=1),
    RankFault(2, "bucket", 0, refit=1),  # an engine's load
    RankFault(2, "finalize", refit=1),  # an engine's post-processing; engine 3 commits and replays
    RankFault(3, "bucket", 3, refit=1),
    RankFault(3, "verify", refit=1),  # an engine's verification before commit
    RankFault(2, "storage", refit=1),  # after engine 2 committed: it is restored, like engine 3
]
# pp=2 (two sources take turns) + engines 2 and 3.
PP_FAULTS = [
    RankFault(1, "export", 0, refit=1),  # the second stage fails after the first streamed
    RankFault(3, "bucket", 0, refit=1),  # an engine fails in stage 0's segment: stage 1 never sends
]


@pytest.fixture(scope="module")
def references() -> dict[int, dict[str, str]]:
    p = support.plan(*PRESETS)
    return {step: support.single_process_digest(p, step) for step in (0, 2)}


def _run(layout: dict[str, int], faults: list[RankFault], commit_mode: str = "transactional") -> list[list[dict]]:
    results = launch_world(support.faults_rank, 4, (layout, 2, PRESETS, commit_mode, faults), timeout_s=120)
    failed = [f"rank {r.rank}: {r.error}\n{r.traceback or ''}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    return [r.value for r in results]


def _check_transactional(results: list[list[dict]], faults: list[RankFault], references: dict) -> None:
    for i, fault in enumerate(faults):
        records = [results[rank][i] for rank in range(4)]
        what = f"fault {fault} on rank {fault.rank}"
        assert all(rec["outcomes"][0] == rec["outcomes"][2] == "live" for rec in records), what
        assert {rec["outcomes"][1] for rec in records} == {"rolled-back"}, what
        errors = {rec["errors"][1] for rec in records}
        assert len(errors) == 1, f"{what}: ranks disagree on the failure: {errors}"
        error = errors.pop()
        assert f"rank {fault.rank} (" in error and "InjectedFault" in error, f"{what}: {error}"
        for rank in (2, 3):
            rec = records[rank]
            assert rec["digests"][1] == references[0], f"{what}: engine {rank} lost its step-0 weights"
            assert rec["digests"][2] == references[2], f"{what}: engine {rank} differs from single-process step 2"
            assert rec["stale"] == [False, False, False], what


def test_any_rank_any_step_tensor_parallel(references: dict) -> None:
    _check_transactional(_run({"tp": 2}, TP_FAULTS), TP_FAULTS, references)


def test_failures_between_pipeline_stages(references: dict) -> None:
    _check_transactional(_run({"pp": 2}, PP_FAULTS), PP_FAULTS, references)


def test_per_layer_engines_become_stale_together(references: dict) -> None:
    faults = [RankFault(2, "bucket", 5, refit=1), RankFault(0, "finalize", refit=1)]
    results = _run({"tp": 2}, faults, commit_mode="per-layer")
    for i, fault in enumerate(faults):
        records = [results[rank][i] for rank in range(4)]
        outcomes = {rec["outcomes"][1] for rec in records}
        assert outcomes == {"stale"}, f"{fault}: {outcomes}"  # every rank reports the same outcome
        assert len({rec["errors"][1] for rec in records}) == 1
        for rank in (2, 3):
            assert records[rank]["stale"] == [False, True, False], f"{fault}: engine {rank}"
            assert records[rank]["digests"][2] == references[2]
