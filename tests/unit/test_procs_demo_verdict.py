"""`refit demo procs`'s verdict on each engine record (app.services.distributed_demo.judge): a live
refit against its step's reference (the single-process refit's digest, or a cold start's verdict
on a real engine), a failed one against the same rank's last live weights; and what an engine
served (app.services.engine_demo.Served) reduced to one fingerprint."""

from __future__ import annotations

import pytest
import torch

from app.cli.main import main
from app.services.distributed_demo import judge, single_process
from app.services.engine_demo import Served


def _engine(step: int, outcome: str, digest: str, *, rank: int = 2, stale: bool = False) -> dict:
    return {"step": step, "rank": rank, "outcome": outcome, "digest": digest, "stale": stale}


def _trainer(step: int) -> dict:
    return {"step": step, "rank": 0, "outcome": "live", "digest": None, "stale": None}


def test_live_records_equal_their_step_and_a_failed_one_its_last_live_weights() -> None:
    records = [_trainer(0), _engine(0, "live", "a"), _engine(1, "rolled-back", "a"), _engine(2, "live", "c")]
    assert judge(records, single_process(["a", "b", "c"])) is True
    assert [r["weights"] for r in records] == ["-", "= single-process", "kept step 0, bit-identical",
                                               "= single-process"]


@pytest.mark.parametrize(("records", "verdict"), [
    ([_engine(0, "live", "x")], "DIFFERENT"),  # not the step's reference
    ([_engine(0, "live", "a"), _engine(1, "rolled-back", "b")], "CHANGED"),  # a failed refit changed it
    ([_engine(0, "rolled-back", "a")], "CHANGED"),  # nothing live before it to have kept
])
def test_an_engine_holding_other_weights_fails_the_demo(records: list[dict], verdict: str) -> None:
    assert judge(records, single_process(["a", "b"])) is False
    assert records[-1]["weights"] == verdict


def test_a_stale_engine_refuses_to_serve_and_passes() -> None:
    records = [_engine(0, "live", "a"), _engine(1, "stale", "z", stale=True)]
    assert judge(records, single_process(["a", "b"])) is True
    assert records[1]["weights"] == "stale (refuses to serve)"


def test_a_real_engines_live_records_take_the_cold_starts_verdict() -> None:
    verdicts = {(2, 0): True, (2, 1): False}
    records = [_engine(0, "live", "f0"), _engine(1, "live", "f1")]
    assert judge(records, lambda r: verdicts[(r["rank"], r["step"])], "cold start") is False
    assert [r["weights"] for r in records] == ["= cold start", "DIFFERENT"]


def _served(log_probs: torch.Tensor, digests: dict[str, str] | None = None) -> Served:
    return Served(log_probs, [[1, 2]], digests or {"w": "d0"}, {})


def test_a_fingerprint_sees_one_ulp_of_a_log_prob_and_one_digest() -> None:
    lp = torch.tensor([[-1.5, -2.25]])
    same = _served(lp.clone()).fingerprint()
    assert _served(lp).fingerprint() == same
    assert _served(torch.nextafter(lp, torch.zeros_like(lp))).fingerprint() != same
    assert _served(lp, {"w": "d1"}).fingerprint() != same


def test_commit_mode_does_not_go_with_a_real_engine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "procs", "--engine", "vllm", "--commit-mode", "per-layer"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("refit demo: ConfigError: --commit-mode: is the embedded engine's"), err
