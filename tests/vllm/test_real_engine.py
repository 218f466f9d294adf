"""Refits into a real vLLM engine (the CPU build of vLLM 0.32), in both deployment shapes, each
refit compared with a cold start of the same exported checkpoint, bit for bit.

- colocated: trainer, rl-refit and an in-process `vllm.LLM` (multiprocessing off) in one process
  of this environment (.venv-vllm); buckets reach the worker by reference.
- disaggregated: the trainer in the project's `.venv` (no vLLM there) starts the vLLM server of
  this environment (`python -m vllm.entrypoints.openai.api_server`, what `vllm serve` runs) and
  refits it as an attached server, through the shared-memory ring rl-refit's weight-transfer
  backend maps (the default), or over a side gloo group it joins.

Every scenario runs in a process of its own (tests.vllm.scenarios): vLLM owns its process's
torch.distributed and global state. Cold starts of identical exports are shared through a cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from domain.quant.support import COMPRESSED_TENSORS, CPU_SERVED, MODELOPT_NVFP4
from tests.dispatching import verdicts

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm), which `make test` creates")

ROOT = Path(__file__).resolve().parents[2]
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"
TIMEOUT_S = 1500


def _python(deployment: str) -> str:
    if deployment == "colocated":
        return sys.executable
    if not MAIN_PYTHON.exists():
        pytest.skip(f"{MAIN_PYTHON} is missing: the disaggregated trainer runs in the project's .venv (`make setup`)")
    return str(MAIN_PYTHON)


# What each cell of the matrix starts: the model and the plan (MoE cells pair their experts with a
# dense format vLLM serves here, where the experts' own format has no dense kernel).
CELLS: dict[str, dict[str, Any]] = {
    "BF16-dense": {"model": "micro-dense", "linear": "BF16", "moe": "BF16"},
    "BF16-experts": {"model": "micro-moe", "linear": "BF16", "moe": "BF16"},
    "FP8_BLOCK-dense": {"model": "micro-dense", "linear": "FP8_BLOCK"},
    "FP8_BLOCK-experts": {"model": "micro-moe", "linear": "FP8_BLOCK", "moe": "FP8_BLOCK"},
    "MXFP8-dense": {"model": "micro-dense", "linear": "MXFP8"},
    "MXFP8-experts": {"model": "micro-moe", "linear": "MXFP8", "moe": "MXFP8"},
    "MXFP4-dense": {"model": "micro-dense", "linear": "MXFP4"},
    "MXFP4-experts": {"model": "micro-moe", "linear": "MXFP8", "moe": "MXFP4"},
    "NVFP4-dense": {"model": "micro-dense", "linear": "NVFP4", "linear_activation": "none"},
    "NVFP4-experts": {"model": "micro-moe", "linear": "MXFP8", "moe": "NVFP4", "moe_activation": "none"},
    # per-token NVFP4 experts, alone: ModelOpt's NVFP4 layout (adapters/vllm/profile.py)
    "NVFP4-experts-per-token": {"model": "micro-moe", "moe": "NVFP4"},
}


def _served() -> frozenset[str]:
    """The cells the support matrix marks served on vLLM's CPU build (CPU_SERVED): each must start
    on any x86-64 CPU, natively where vLLM has a kernel, else with its matmul emulated
    (adapters.vllm.cpu_emulation), and equal its cold start. Every other cell runs where vLLM
    starts it (and must then equal its cold start too), and is skipped with vLLM's own reason where
    vLLM cannot start it: never by the CPU's name."""
    names = {"BF16-dense", "BF16-experts"}
    for v in verdicts().values():
        c = v.cell
        if c.engine == "vllm" and c.layout == COMPRESSED_TENSORS and CPU_SERVED in v.how:
            names.add(f"{c.fmt}-{'dense' if c.role == 'linear' else 'experts'}")
        elif c.engine == "vllm" and c.layout == MODELOPT_NVFP4 and CPU_SERVED in v.how:
            names.add(f"{c.fmt}-experts-per-token")
    return frozenset(names)


SERVED = _served()


def scenario(cold_cache: Path, cell: str | None = None, **spec: Any) -> dict[str, Any]:
    result = run_scenario(cold_cache, cell, **spec)
    if "not_started" in result:
        assert cell not in SERVED, f"{cell} must start on any x86-64 CPU: {result['not_started']}"
        pytest.skip(f"vLLM {cell or spec} does not start on this CPU: {result['not_started']}")
    return result


def run_scenario(cold_cache: Path, cell: str | None = None, **spec: Any) -> dict[str, Any]:
    """The scenario's JSON result (`not_started` holds why the engine did not start)."""
    spec = {"model": "micro-moe", **(CELLS[cell] if cell else {}), **spec, "cold_cache": str(cold_cache)}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["RL_REFIT_VLLM_PYTHON"] = sys.executable  # the engine host runs in this environment
    done = subprocess.run([_python(spec["deployment"]), "-m", "tests.vllm.scenarios", json.dumps(spec)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, f"scenario failed ({done.returncode}):\n{done.stderr[-6000:]}"
    result = json.loads(lines[-1])
    assert "error" not in result, result["error"] + "\n" + done.stderr[-4000:]
    return result


def _by_name(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["name"]: s for s in result["steps"]}


def _equal(step: dict[str, Any]) -> None:
    assert step["ok"], step["error"]
    assert step["equals_cold_start"], (
        f"{step['name']}: log-probs equal {step['logprobs_equal']}, tokens equal {step['tokens_equal']}, "
        f"tensors that differ {step['differing']}")
    assert step["storage_ok"] and step["storage_changed"] == []
    assert step["unwritten"] == [] and step["parameters_written"] > 0
    # left out of the byte comparison: only activation scales no load of the export writes
    assert all(name.endswith(("input_global_scale", "input_scale")) for name in step["not_compared"])


def _stale_then_recovered(steps: dict[str, dict[str, Any]], fault: str) -> None:
    failed, after = steps[f"fault {fault}"], steps[f"after {fault}"]
    assert not failed["ok"] and failed["outcome"] == "stale", failed
    assert failed["serving"] == "no (stale)"  # refuses to serve
    _equal(after)


# Every cell colocated; a few through the server rl-refit starts (disaggregated). A server's
# workers run the same WorkerRefit on every format as the colocated worker does; what the shape adds
# is the server, its transport and its control plane, which these cells cover: BF16, a quantized
# compressed-tensors layout on dense layers and experts, and ModelOpt's NVFP4 experts (another
# quantization method the probe must recognise).
SERVER_CELLS = ("BF16-dense", "FP8_BLOCK-experts", "NVFP4-experts-per-token")
# `make test` runs, colocated, the cells no server cell covers, which between them reach every
# format vLLM serves here on dense layers and on experts (MXFP8 dense layers: the MoE cells'); the
# colocated twins of the server cells, MXFP8-dense, and the cells vLLM's CPU build cannot start
# (they are the GPU's, skipped with vLLM's reason) are `heavy`: `make bench` runs them.
HEAVY_CELLS = (*SERVER_CELLS, "MXFP8-dense", "MXFP4-dense", "MXFP4-experts", "NVFP4-dense")
MATRIX = [
    *(pytest.param("colocated", cell, id=f"colocated-{cell}", marks=[pytest.mark.heavy] if cell in HEAVY_CELLS else [])
      for cell in CELLS),
    *(pytest.param("disaggregated", cell, id=f"disaggregated-{cell}") for cell in SERVER_CELLS),
]


@pytest.mark.slow
@pytest.mark.parametrize(("deployment", "cell"), MATRIX)
def test_refits_equal_a_cold_start_twice_in_a_row_and_back(cold_cache: Path, deployment: str, cell: str) -> None:
    result = scenario(cold_cache, cell, scenario="matrix", deployment=deployment)
    assert result["refused_before_first_refit"]
    assert result["transport"] == ("shm" if deployment == "disaggregated" else None)
    steps = _by_name(result)
    assert list(steps) == ["first", "second", "back"]
    for step in steps.values():
        _equal(step)
    assert result["rebound"] == []  # no parameter or buffer rebound over the three refits


@pytest.mark.slow
def test_refits_over_the_gloo_transport_equal_a_cold_start(cold_cache: Path) -> None:
    """rollout.engine_kwargs.vllm.transport=gloo: the side process group instead of the ring."""
    result = scenario(cold_cache, "FP8_BLOCK-experts", scenario="matrix", deployment="disaggregated",
                      transport="gloo")
    assert result["transport"] == "gloo"
    steps = _by_name(result)
    assert list(steps) == ["first", "second", "back"]
    for step in steps.values():
        _equal(step)


@pytest.mark.heavy  # make test runs the processes' shape, tp 2 (test_procs_demo.py); make bench this one
def test_a_distributed_refit_from_sharded_trainer_ranks_equals_a_cold_start(cold_cache: Path) -> None:
    """The distributed refit (what `services.world.distributed_refit` gives every rank of a Megatron
    trainer, docs/megatron-sharded.md) into the server rl-refit starts: two trainer ranks hold the
    tensor-parallel (tp 2) and expert-parallel (ep 2) shares of the embedded trainer, and one
    engine rank holds the vLLM engine. FP8_BLOCK's 128-column blocks span both tensor-parallel
    shares of o_proj and down_proj, so those go whole to the source rank and are quantized there:
    every refit equals a cold start of the single process's export, bit for bit."""
    result = scenario(cold_cache, "FP8_BLOCK-experts", scenario="distributed", deployment="disaggregated",
                      layout=[2, 1, 2, 1])
    assert result["ranks"] == 3  # two trainer ranks and the engine's
    steps = _by_name(result)
    assert list(steps) == ["first", "second", "back"]
    for step in steps.values():
        _equal(step)
    assert result["rebound"] == []


def _restored_then_recovered(steps: dict[str, dict[str, Any]], fault: str, previous: dict[str, Any]) -> None:
    failed, after = steps[f"fault {fault}"], steps[f"after {fault}"]
    assert not failed["ok"] and failed["outcome"] == "rolled-back", failed
    assert failed["serving"] == "yes"  # the previous refit's weights, put back by the server's workers
    assert failed["digests"] == previous["digests"] and failed["served_log_probs"] == previous["served_log_probs"]
    _equal(after)


@pytest.mark.slow
@pytest.mark.parametrize("deployment", ["colocated", "disaggregated"])
def test_a_fault_at_any_step_is_undone_or_leaves_the_engine_stale_and_the_next_refit_recovers_it(
        cold_cache: Path, deployment: str) -> None:
    """Colocated, vLLM's layerwise reload keeps no copy of the old weights: a failed refit leaves the
    engine stale (refusing to serve). The server rl-refit starts (disaggregated) keeps the last live
    refit's buckets in its workers and puts them back: it serves the previous weights, bit for bit."""
    result = scenario(cold_cache, "FP8_BLOCK-experts", scenario="faults", deployment=deployment)
    steps = _by_name(result)
    _equal(steps["first"])
    previous = steps["first"]
    for fault in ("bucket:1", "finalize", "receiver"):
        if deployment == "colocated":
            _stale_then_recovered(steps, fault)
        else:
            _restored_then_recovered(steps, fault, previous)
        previous = steps[f"after {fault}"]
    assert "injected receiver fault" in steps["fault receiver"]["error"]


@pytest.mark.slow
def test_kv_scales_are_reset_and_the_probe_catches_a_corrupted_refit(cold_cache: Path) -> None:
    result = scenario(cold_cache, "FP8_BLOCK-experts", scenario="guards", deployment="disaggregated")
    steps = _by_name(result)
    poisoned = steps["after kv poison"]
    assert poisoned["poisoned_layers"] == 2  # both attention layers of micro-moe
    assert all(v == [7.0, 7.0, 7.0, 7.0] for v in poisoned["scales_before"].values())
    _equal(poisoned)
    assert poisoned["kv_scales_reset"] == 2
    assert all(v == [1.0, 1.0, 1.0, 1.0] for v in poisoned["kv_scales"].values()) and len(poisoned["kv_scales"]) == 2
    clean, corrupted, again = steps["probe, clean"], steps["probe, corrupted"], steps["probe, clean again"]
    _equal(clean)
    assert clean["probe"]["passed"] and clean["probe"]["max_abs_diff"] <= clean["probe"]["bound"]
    # refused after it went live: the server's workers put the previous refit back, and it serves again
    assert not corrupted["ok"] and corrupted["outcome"] == "rolled-back" and corrupted["serving"] == "yes"
    assert corrupted["digests"] == clean["digests"] and corrupted["served_log_probs"] == clean["served_log_probs"]
    assert "ProbeMismatch" in corrupted["error"] and not corrupted["probe"]["passed"]
    assert corrupted["storage_ok"]  # what the probe exists for: pointers right, bytes wrong
    _equal(again)


@pytest.mark.slow
def test_bf16_moe_refits_are_right_and_vllms_reload_alone_is_not(cold_cache: Path) -> None:
    result = scenario(cold_cache, "BF16-experts", scenario="guards", deployment="colocated")
    steps = _by_name(result)
    for name in ("first", "after kv poison", "probe, clean", "probe, clean again"):
        _equal(steps[name])
    assert not steps["probe, corrupted"]["ok"] and "ProbeMismatch" in steps["probe, corrupted"]["error"]
    # The same refit with the expert redo switched off serves other expert bytes than a cold start,
    # with the storage check passing: the silent corruption the redo prevents.
    off = steps["without the expert redo"]
    assert off["ok"] and off["storage_ok"] and off["equals_cold_start"] is False
    assert off["differing"] and all(".experts." in name for name in off["differing"])


@pytest.mark.slow
@pytest.mark.parametrize(("deployment", "fixture", "moe"), [
    pytest.param("colocated", "tiny-qwen3", "FP8_BLOCK", marks=pytest.mark.heavy),  # the server's twin in make test
    ("disaggregated", "tiny-qwen3", "FP8_BLOCK"),
    pytest.param("colocated", "tiny-qwen3-moe", "BF16", marks=pytest.mark.heavy),
])
def test_your_own_tied_checkpoint_refits_and_equals_a_cold_start(cold_cache: Path, tmp_path: Path, deployment: str,
                                                                   fixture: str, moe: str) -> None:
    """`refit demo vllm --model DIR`'s path on a tied Qwen3 / Qwen3-MoE written by
    transformers: no lm_head.weight is sent, none is unwritten, and the served head follows the
    embeddings (vLLM's CPU build packs it outside the parameters)."""
    from adapters.hf.fixtures import write_fixture

    model = write_fixture(fixture, tmp_path / fixture)
    result = scenario(cold_cache, scenario="matrix", deployment=deployment, model=str(model),
                      linear="FP8_BLOCK", moe=moe)
    assert result["refused_before_first_refit"]
    steps = _by_name(result)
    assert list(steps) == ["first", "second", "back"]
    for step in steps.values():
        _equal(step)
    assert result["rebound"] == []


# BF16 colocated, FP8_BLOCK in both shapes (a server keeps no backup once delta refits are on: its
# failed delta is refused and sent whole); the other formats (served here through the CPU emulation
# kernels) colocated, which exercises the same worker-side receiver.
DELTA_CASES = [  # `make test`: the server's FP8_BLOCK and the colocated NVFP4 experts; the rest `make bench`
    pytest.param("colocated", "BF16-dense", id="colocated-BF16-dense", marks=pytest.mark.heavy),
    pytest.param("colocated", "FP8_BLOCK-dense", id="colocated-FP8_BLOCK-dense", marks=pytest.mark.heavy),
    pytest.param("disaggregated", "FP8_BLOCK-dense", id="disaggregated-FP8_BLOCK-dense"),
    pytest.param("colocated", "MXFP8-dense", id="colocated-MXFP8-dense", marks=pytest.mark.heavy),
    pytest.param("colocated", "NVFP4-experts", id="colocated-NVFP4-experts"),
]


# The merged LoRA mode: the adapter merged into the base at export (W + (alpha/r)·B·A), then the
# plan's quantization and a normal refit; each refit must equal a cold start of the merged export.
LORA_MERGED_CASES = [  # the merged export is an ordinary refit: the server's path is the matrix's
    pytest.param("colocated", "BF16-dense", id="colocated-BF16-dense", marks=pytest.mark.heavy),
    pytest.param("colocated", "FP8_BLOCK-dense", id="colocated-FP8_BLOCK-dense", marks=pytest.mark.heavy),
    pytest.param("colocated", "MXFP8-dense", id="colocated-MXFP8-dense", marks=pytest.mark.heavy),
]  # all in `make bench`: a merged export is refitted as any model is (the matrix's cells in make test)


@pytest.mark.slow
@pytest.mark.parametrize(("deployment", "cell"), LORA_MERGED_CASES)
def test_merged_lora_refits_equal_a_cold_start_of_the_merged_export(cold_cache: Path, deployment: str,
                                                                       cell: str) -> None:
    result = scenario(cold_cache, cell, scenario="matrix", deployment=deployment, lora=8)
    steps = _by_name(result)
    assert list(steps) == ["first", "second", "back"]
    for step in steps.values():  # the second refit moved only the adapter, the third moved it back
        _equal(step)
    assert result["rebound"] == []


@pytest.mark.slow
@pytest.mark.parametrize(("deployment", "cell"), DELTA_CASES)
def test_delta_refits_equal_full_refits_bit_for_bit(cold_cache: Path, deployment: str, cell: str) -> None:
    result = scenario(cold_cache, cell, scenario="delta", deployment=deployment)
    steps = _by_name(result)
    _equal(steps["first"])
    for name in ("delta base", "delta lr=0.0001", "delta lr=0.001", "corrupted copy", "after corrupted copy"):
        assert steps[name]["ok"], steps[name]
        assert steps[name]["equal_to_full"], f"{name}: differs from a full refit in {steps[name]['differing']}"
    modes = {n: (s["mode"], s["why_full"]) for n, s in steps.items() if n.startswith("delta")}
    assert [m for m, _ in modes.values()] == ["full", "delta", "delta"], modes
    assert all(steps[n]["ratio"] < 1 for n in ("delta lr=0.0001", "delta lr=0.001"))  # less than a full refit
    corrupted = steps["corrupted copy"]  # the engine refused the delta; the same refit went whole
    assert corrupted["attempts"] == 2 and corrupted["refused_mode"] == "delta"
    assert corrupted["refused_outcome"] == "stale"  # never mixed
    assert "base copy was corrupted" in corrupted["refused_error"], corrupted
    assert corrupted["mode"] == "full" and "the same refit sent whole" in corrupted["why_full"], corrupted
    assert steps["after corrupted copy"]["mode"] == "delta", steps["after corrupted copy"]
    assert result["rebound"] == []


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("cell", ["BF16-dense"])
def test_a_tensor_parallel_engine_of_two_workers_equals_a_cold_start(cold_cache: Path, cell: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """tensor_parallel_size=2 on vLLM's CPU build (disaggregated: its workers are processes of their
    own). The adapter binds each worker's threads to half of the cores this process is given
    (VLLM_CPU_OMP_THREADS_BIND, e.g. 0|1); the cold start of the same run gets the same binding and
    runs beside the live engine. Both workers receive every bucket, and the digests compared are
    every worker's shard."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two workers need two cores to bind to; this process is given one")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)  # the suite's `nobind` (conftest): the adapter's binding
    # digests of two shards are named worker0/..., worker1/...: not those of a one-worker cold start
    result = scenario(cold_cache / "tp2", cell, scenario="matrix", deployment="disaggregated", tensor_parallel_size=2)
    assert result["workers"] == [2]
    assert all(name.startswith("worker0/") for name in result["digest_names"])
    steps = _by_name(result)
    assert list(steps) == ["first", "second", "back"]
    for step in steps.values():
        _equal(step)
    assert result["rebound"] == []


@pytest.mark.slow
@pytest.mark.heavy  # make test covers each replica's path (one engine of the same cell) and the wiring with fakes
def test_two_replicas_refitted_by_one_refit_each_equal_a_cold_start(cold_cache: Path) -> None:
    """rollout.replicas=2: two vLLM engines (each in processes of its own) take every bucket of one
    refit; each replica is compared with the cold start of the same export, bit for bit."""
    result = scenario(cold_cache, "FP8_BLOCK-dense", scenario="matrix", deployment="disaggregated", replicas=2)
    assert result["replicas"] == 2 and result["workers"] == [1, 1]
    steps = _by_name(result)
    assert list(steps) == [f"{label} replica {i}" for label in ("first", "second", "back") for i in (0, 1)]
    for step in steps.values():
        _equal(step)
    assert result["rebound"] == []


@pytest.mark.slow
def test_a_tensor_parallel_engine_that_cannot_start_names_its_workers_error_and_the_log(cold_cache: Path) -> None:
    """FP8_BLOCK at tensor_parallel_size=2 on micro-dense: each worker holds 64 rows of a 128-row
    projection, less than one 128-row block, and vLLM's workers refuse it as they build the model.
    The error that reaches the trainer is that worker's first `Error:` line, not vLLM's wrappers
    ("Engine core initialization failed. See root cause above"), and names the engine's log."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two workers need two cores to bind to; this process is given one")
    result = run_scenario(cold_cache / "tp2", None, model="micro-dense", linear="FP8_BLOCK", scenario="matrix",
                          deployment="disaggregated", tensor_parallel_size=2)
    why = result["not_started"]
    assert why.startswith("EngineProcessError: the vLLM engine failed to start: ValueError: Weight "
                          "output_partition_size = 64 is not divisible by weight quantization block_n = 128"), why
    log = Path(why.rsplit("engine log: ", 1)[1].strip())
    text = log.read_text(errors="replace")
    assert "(Worker_TP" in text and "See root cause" in text  # raised in a worker, wrapped by vLLM's engine core
    log.unlink()
