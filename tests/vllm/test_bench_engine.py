"""`refit bench engine` on a real vLLM engine (the CPU build), colocated, one round: every
baseline and floor is measured, and vLLM's reload_weights of the checkpoint, into an engine holding other
weights, leaves exactly the bytes rl-refit's refit left (FP8_BLOCK micro-moe). Structure only:
timings are the bench's business, never a test's.

The bench runs in a process of its own (vLLM owns its process's global state).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm), which `make test` creates")

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 900
SCRIPT = """
import json
from app.bench.engine import EngineBenchSettings, run
report = run(settings=EngineBenchSettings(deployment="colocated", preset="FP8_BLOCK", repeat=1))
print("REPORT " + json.dumps(report.to_dict()))
"""


@pytest.fixture(scope="module")
def report() -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and lines, f"the bench failed ({done.returncode}):\n{done.stderr[-6000:]}"
    return json.loads(lines[-1].removeprefix("REPORT "))  # type: ignore[no-any-return]


def test_every_baseline_is_measured(report: dict[str, object]) -> None:
    from adapters.vllm.bench import BASELINES
    from app.bench.engine import BF16_REFIT, COPY, RECEIVE, RESTART

    RELOAD, LAYERWISE, WRITE_RELOAD, LOAD_WEIGHTS = (BASELINES.labels[k] for k in
                                                     ("reload", "layerwise", "write_reload", "load_weights"))

    rows = {r["baseline"]: r for r in report["rows"] if r["baseline"]}  # type: ignore[attr-defined]
    measured = [RELOAD, LAYERWISE, RECEIVE, WRITE_RELOAD, LOAD_WEIGHTS, RESTART]
    # then the same model's BF16 refit (a quantized preset's row beside it), the memory bound, and
    # the trainer's memory row
    assert list(rows) == [*measured, BF16_REFIT, COPY, "bound: 2 buckets"]
    for row in (rows[name] for name in measured):
        assert row["case"] == "micro-moe FP8_BLOCK colocated bucket 1 MiB"
        assert row["value"] > 0 and row["baseline_value"] > 0 and row["ratio"] is not None
    notes = report["notes"]
    assert any(n.startswith("where the refit's time goes") for n in notes), notes  # type: ignore[attr-defined]
    assert any(n.startswith("bound: ") for n in notes), notes  # type: ignore[attr-defined]


def test_vllm_reload_leaves_the_bytes_of_the_refit(report: dict[str, object]) -> None:
    notes = report["notes"]
    assert not any("could not be measured" in n for n in notes), notes  # type: ignore[attr-defined]
    assert not any("did NOT hold" in n for n in notes), notes  # type: ignore[attr-defined]  # put back intact
    assert any("from an engine holding other weights" in n and "exactly the bytes" in n  # type: ignore[attr-defined]
               for n in notes), notes
    assert any(n.startswith("rl-refit's refit by phase") for n in notes)  # type: ignore[attr-defined]
