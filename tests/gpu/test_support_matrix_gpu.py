"""The prepared H200 check of the support matrix's NVFP4 and MX cells (check_support_matrix.py), and
its pure parts on CPU: which cells it runs, the layout it expects vLLM to allocate, the verdict."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
import torch

from domain.quant.plan import QuantizationPlan
from domain.quant.stream import quantize_stream
from domain.quant.support import COMPRESSED_TENSORS, GPU_SCRIPT, plan_cells
from tests.dispatching import DispatchInput, resolve, verdicts

HERE = pathlib.Path(__file__).resolve().parent
SCRIPT = HERE / "check_support_matrix.py"


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("check_support_matrix", SCRIPT)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


S = _script()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (vLLM's NVFP4 / MX schemes)")
def test_vllm_nvfp4_and_mx_cells_on_gpu(tmp_path: pathlib.Path) -> None:
    have_vllm = importlib.util.find_spec("vllm") is not None
    cmd = [sys.executable, str(SCRIPT), "--out", str(tmp_path), *(["--python", sys.executable] if have_vllm else [])]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=480)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert json.loads((tmp_path / "summary.json").read_text())["ok"]


# --- CPU: the arms are the table's GPU cells, and vLLM accepts each ------------------------------------


def _plan(arm: str) -> QuantizationPlan:
    return QuantizationPlan.from_presets(**S.ARMS[arm])


def test_the_arms_run_exactly_the_cells_the_table_marks_for_the_gpu_script() -> None:
    marked = {c for c, v in verdicts().items() if c.engine == "vllm" and GPU_SCRIPT in v.how}
    run = {c for arm in S.ARMS for c in plan_cells("vllm", _plan(arm), COMPRESSED_TENSORS)}
    assert run == marked
    assert {c.fmt for c in run} == {"MXFP8", "MXFP4", "NVFP4"}
    assert all(verdicts()[c].shown for c in run)
    assert set(S.BLACKWELL_KERNELS) == set(S.ARMS)


@pytest.mark.parametrize("arm", list(S.ARMS))
def test_refit_plan_accepts_every_arm_for_vllm(arm: str) -> None:
    res = resolve(DispatchInput(engine="vllm", requested=_plan(arm)))
    assert res.layout == COMPRESSED_TENSORS and res.plan == _plan(arm)


# --- CPU: the layout vLLM allocates, from the export -----------------------------------------------------


def _toy(experts: int = 2, hidden: int = 64, inter: int = 32) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    p = "model.layers.0"
    named = [(f"{p}.self_attn.{x}_proj.weight", torch.randn(n, hidden, generator=g))
             for x, n in (("q", 64), ("k", 32), ("v", 32))]
    named.append((f"{p}.self_attn.o_proj.weight", torch.randn(hidden, 64, generator=g)))
    named.append((f"{p}.mlp.gate.weight", torch.randn(experts, hidden, generator=g)))
    for e in range(experts):
        named += [(f"{p}.mlp.experts.{e}.gate_proj.weight", torch.randn(inter, hidden, generator=g)),
                  (f"{p}.mlp.experts.{e}.up_proj.weight", torch.randn(inter, hidden, generator=g)),
                  (f"{p}.mlp.experts.{e}.down_proj.weight", torch.randn(hidden, inter, generator=g))]
    return named


def _sent(plan: QuantizationPlan) -> dict[str, tuple[list[int], str]]:
    return {n: (list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in quantize_stream(plan, _toy())}


def test_engine_layout_stacks_shards_and_experts_as_vllm_allocates_them() -> None:
    layout = S.engine_layout(_sent(_plan("nvfp4-a16")))
    a, x = "model.layers.0.self_attn", "model.layers.0.mlp.experts"
    # q/k/v along dim 0; one global scale per shard (CompressedTensorsW4A4Fp4.create_weights)
    assert layout[f"{a}.qkv_proj.weight_packed"] == ([128, 32], "uint8")
    assert layout[f"{a}.qkv_proj.weight_scale"] == ([128, 4], "float8_e4m3fn")
    assert layout[f"{a}.qkv_proj.weight_global_scale"] == ([3], "float32")
    assert layout[f"{a}.o_proj.weight_global_scale"] == ([1], "float32")
    # experts: w13 = gate and up per expert [E, 2I, H/2], global [E, 2]; w2 [E, H, I/2], global [E]
    assert layout[f"{x}.w13_weight_packed"] == ([2, 64, 32], "uint8")
    assert layout[f"{x}.w13_weight_global_scale"] == ([2, 2], "float32")
    assert layout[f"{x}.w2_weight_packed"] == ([2, 64, 16], "uint8")
    assert layout[f"{x}.w2_weight_global_scale"] == ([2], "float32")
    assert layout["model.layers.0.mlp.gate.weight"] == ([2, 64], "float32")  # BF16 router passes through


def test_compare_layouts_finds_every_kind_of_difference() -> None:
    expected = S.engine_layout(_sent(_plan("mxfp4")))
    x = "model.layers.0.mlp.experts"
    allocated = {n.replace(".experts.", ".experts.routed_experts.") if ".experts.w" in n else n: v
                 for n, v in expected.items()}  # vLLM 0.33's RoutedExperts child is aliased back
    clean = S.compare_layouts(expected, allocated)
    assert clean == {"unexported": [], "unallocated": [], "shape": [], "dtype": []}
    a = "model.layers.0.self_attn.qkv_proj"
    broken = dict(allocated)
    broken[f"{a}.input_global_scale"] = ([3], "float32")  # what per-token NVFP4 allocates and nobody sends
    broken[f"{x}.routed_experts.w13_input_global_scale"] = ([2, 2], "float32")  # allowed, with its reason
    broken[f"{a}.weight_scale"] = (allocated[f"{a}.weight_scale"][0], "float8_e4m3fn")
    broken[f"{a}.weight_packed"] = ([1, 1], "uint8")
    del broken["model.layers.0.self_attn.o_proj.weight_scale"]
    diff = S.compare_layouts(expected, broken)
    assert diff["unexported"] == [f"{a}.input_global_scale: float32 [3]"]
    assert diff["unallocated"] == ["model.layers.0.self_attn.o_proj.weight_scale"]
    assert len(diff["shape"]) == 1 and "weight_packed" in diff["shape"][0]
    assert len(diff["dtype"]) == 1 and "weight_scale" in diff["dtype"][0]


def test_engine_layout_refuses_pieces_that_disagree() -> None:
    sent = _sent(_plan("mxfp8"))
    sent["model.layers.0.self_attn.k_proj.weight_scale"] = ([32, 2], "float32")
    with pytest.raises(ValueError, match=r"qkv_proj\.weight_scale"):
        S.engine_layout(sent)


# --- CPU: the verdict ------------------------------------------------------------------------------------


def _arm(**extra):  # type: ignore[no-untyped-def]
    serve = {"logprobs": [[-1.0, -2.0]], "greedy": [[1, 2, 3, 4]]}
    refit = {**serve, "stale_before_refit": True, "refits": [{"storage_changed": []}, {"storage_changed": []}],
             "layout": {"unexported": [], "unallocated": [], "shape": [], "dtype": []}, "kernels": {"qkv_proj": "X"}}
    return serve, {**refit, **extra}


def _results(**extra):  # type: ignore[no-untyped-def]
    out = {}
    for arm in S.ARMS:
        cold, refit = _arm(**extra)
        out[f"{arm}-cold"], out[f"{arm}-refit"] = cold, refit
    return out


def test_verdict_passes_a_clean_run_and_names_the_kernels_not_run_on_sm90() -> None:
    ok, lines = S.verdict(_results(), [9, 0])
    assert ok
    skipped = [line for line in lines if "not run" in line]
    assert len(skipped) == len(S.ARMS) and all("SM90" in line and "SM100" in line for line in skipped)
    ok, lines = S.verdict(_results(), [10, 0])
    assert ok and not any("not run" in line for line in lines)


@pytest.mark.parametrize("extra", [
    {"layout": {"unexported": ["x.input_global_scale: float32 [3]"], "unallocated": [], "shape": [], "dtype": []}},
    {"stale_before_refit": False},
    {"refits": [{"storage_changed": ["x"]}, {"storage_changed": []}]},
    {"logprobs": [[-1.0, -3.5]]},
    {"greedy": [[1, 9, 9, 9]]},
])
def test_verdict_fails_on_any_broken_check(extra: dict) -> None:
    assert not S.verdict(_results(**extra), [9, 0])[0]


def test_verdict_fails_when_an_engine_did_not_run() -> None:
    results = _results()
    results["mxfp4-refit"] = {"error": "ValueError: no kernel"}
    ok, lines = S.verdict(results, [9, 0])
    assert not ok and any("FAILED to run (refit): ValueError" in line for line in lines)
    del results["mxfp8-cold"]
    assert not S.verdict(results, [9, 0])[0]


def test_compare_serving_is_bit_identical_only_when_everything_is_equal() -> None:
    cold, refit = _arm()
    assert S.compare_serving(cold, refit)["bit_identical"]
    near = {**refit, "logprobs": [[-1.0, -2.01]]}
    cmp = S.compare_serving(cold, near)
    assert cmp["ok"] and not cmp["bit_identical"] and cmp["max_abs_logp"] == pytest.approx(0.01)


def test_the_script_names_the_pinned_vllm() -> None:
    from adapters.vllm.profile import PINNED_VLLM

    assert S.pinned_vllm() == PINNED_VLLM
