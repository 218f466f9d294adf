"""`refit demo procs N`: trainer and engine ranks in separate processes, checked against the
single-process refit by the command itself; an injected fault is reported alike by every rank."""

from __future__ import annotations

import json

import pytest

from app.cli.main import main

pytestmark = pytest.mark.distributed


def _demo(capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, dict]:
    rc = main(["demo", "--model", "micro-moe", "--steps", "1", "--bucket-mb", "0.0625", "--json", *extra])
    return rc, json.loads(capsys.readouterr().out)


def test_three_processes_with_a_fault_on_the_engine(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _demo(capsys, "procs", "3", "--inject-fault", "bucket:1", "--fault-step", "1")
    assert rc == 0 and out["engines_match_single_process"] is True
    assert out["world"] == {"layout": "tp=1 pp=1 ep=2", "engines": 1}
    records = {(r["step"], r["rank"]): r for r in out["records"]}
    assert sorted(records) == [(s, r) for s in (0, 1) for r in range(3)]
    assert all(records[(0, r)]["outcome"] == "live" for r in range(3))
    failed = [records[(1, r)] for r in range(3)]
    assert {r["outcome"] for r in failed} == {"rolled-back"}
    assert len({r["error"] for r in failed}) == 1 and "rank 2 (engine) at bucket 1" in failed[0]["error"]
    assert records[(1, 2)]["weights"] == "kept step 0, bit-identical"


def test_procs_out_of_range_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "procs", "5"]) == 2
    assert "--procs: must be 2, 3 or 4" in capsys.readouterr().err


def test_a_hang_at_verify_on_one_of_two_engines_leaves_both_as_they_say(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _demo(capsys, "procs", "4", "--inject-fault", "hang:verify", "--fault-rank", "2")
    assert rc == 0 and out["engines_match_single_process"] is True and out["fault_fired"] is True
    failed = [r for r in out["records"] if r["step"] == 1 and r["role"] == "engine"]
    assert len(failed) == 2 and all(r["weights"] == "kept step 0, bit-identical" for r in failed), failed


def test_text_and_json_agree_on_the_exit_status(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import app.cli.demo_procs as demo_procs

    real = demo_procs.judge

    def judge(records: list, references: object) -> bool:  # as if an engine held other weights
        real(records, references)  # it also labels each record's weights
        return False

    monkeypatch.setattr(demo_procs, "judge", judge)
    rc, out = _demo(capsys, "procs", "2")
    assert rc == 1 and out["engines_match_single_process"] is False
    assert main(["demo", "--model", "micro-moe", "--steps", "1", "--bucket-mb", "0.0625", "procs", "2"]) == 1
    assert "every engine holds what it should (bit-identical to the single-process refit" in capsys.readouterr().out


def test_an_export_fault_on_the_default_rank_runs(capsys: pytest.CaptureFixture[str]) -> None:
    # the trainer rank's shards are wrapped by the fault: the demo perturbs the model behind them
    rc, out = _demo(capsys, "procs", "2", "--inject-fault", "export:0")
    assert rc == 0 and out["fault_fired"] is True and out["engines_match_single_process"] is True


def test_a_typed_error_inside_a_rank_is_one_line_and_exit_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "procs", "2", "--steps", "1", "--inject-fault", "export:0", "--fault-rank", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("refit demo: RankFailed: rank 1: ConfigError: --fault-rank: rank 1 is an engine; export faults "
                   "hit trainer ranks"), err
