"""`refit demo --procs N`: trainer and engine ranks in separate processes, checked against the
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
    rc, out = _demo(capsys, "--procs", "3", "--inject-fault", "bucket:1", "--fault-step", "1")
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
    assert main(["demo", "--procs", "5"]) == 2
    assert "--procs: must be 2, 3 or 4" in capsys.readouterr().err
