"""The adapter LoRA mode (`actor.lora.sync: adapter`) in a real vLLM engine, both deployment
shapes: after 1, 2 and 3 updates the adapter that came through the refit equals its disk twin
(the same adapter loaded by vLLM itself from a PEFT directory with its own `LoRARequest`), prompt
log-probs and greedy tokens bit for bit; a staging that fails on a worker and a base refit that
fails in the same step leave the previous adapter serving, still equal to its twin; the next step
goes live. On quantized bases the matmuls run on the CPU emulation kernels where vLLM has none.
Each scenario runs in a process of its own (tests.vllm.lora_scenarios)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from domain.lora import WIRE_BUDGET_FACTOR
from tests.vllm.test_real_engine import CELLS, ROOT, SERVED, TIMEOUT_S, _python

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm), which `make test` creates")

# A server (disaggregated) takes each adapter through vLLM's own LoRA routes whatever the base's
# format; colocated, the worker builds it from the sent tensors on a BF16 and a quantized base.
CASES = [
    # make test keeps one cell per shape and per format; make bench adds the colocated BF16 twin
    pytest.param("colocated", "BF16-dense", id="colocated-BF16", marks=pytest.mark.heavy),
    pytest.param("disaggregated", "BF16-dense", id="disaggregated-BF16"),
    pytest.param("colocated", "FP8_BLOCK-dense", id="colocated-FP8_BLOCK"),
]


def _scenario(deployment: str, cell: str) -> dict[str, Any]:
    spec = {**CELLS[cell], "deployment": deployment}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["RL_REFIT_VLLM_PYTHON"] = sys.executable  # the engine host runs in this environment
    done = subprocess.run([_python(deployment), "-m", "tests.vllm.lora_scenarios", json.dumps(spec)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, f"scenario failed ({done.returncode}):\n{done.stderr[-6000:]}"
    result = json.loads(lines[-1])
    if "not_started" in result:
        assert cell not in SERVED, f"{cell} must start on any x86-64 CPU: {result['not_started']}"
        pytest.skip(f"vLLM {cell} with LoRA does not start on this CPU: {result['not_started']}")
    return result


def _twin(step: dict[str, Any]) -> None:
    assert step["logprobs_equal"], f"log-probs differ from the disk twin by up to {step['max_abs_diff']}"
    assert step["tokens_equal"], "greedy tokens differ from the disk twin"


@pytest.mark.slow
@pytest.mark.parametrize(("deployment", "cell"), CASES)
def test_adapter_updates_equal_vllms_own_load_of_the_same_adapter(deployment: str, cell: str) -> None:
    result = _scenario(deployment, cell)
    updates = result["updates"]
    assert [u["update"] for u in updates] == [1, 2, 3]
    for u in updates:
        assert u["live"], u["error"]
        _twin(u)
        assert u["moved"]  # each update changed what the engine serves
        assert u["held"] == [u["update"]]  # the previous id was dropped: one adapter held
        assert u["bytes_sent"] <= WIRE_BUDGET_FACTOR * u["adapter_bytes"]
    assert [u["base_sent"] for u in updates] == [True, False, False]  # the base only when it changed

    stage = result["failed_stage"]  # a worker failed after building the new adapter
    assert not stage["live"] and "adapter 3 still serves" in stage["error"]
    _twin(stage)
    assert stage["held"] == [3]  # the half-staged adapter was dropped

    base = result["failed_base"]  # the base refit of the same step failed: neither went live
    assert not base["live"] and base["adapter_id"] == 3 and "the base refit failed" in base["error"]
    # colocated, the previous buckets are streamed again (replay); a server's workers put their own backup back
    assert (base["base_outcome"], base["engine_state"]) == ("rolled-back", "restored" if deployment == "colocated"
                                                            else "kept")
    _twin(base)
    assert base["held"] == [3]

    again = result["recovered"]
    assert again["live"], again["error"]
    assert again["base_sent"]  # the base the failed step did not send goes with the next one
    _twin(again)
