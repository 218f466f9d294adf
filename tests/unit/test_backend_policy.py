"""Backend policy (docs/engines.md#kernel-backends-backend-policy): one test per rule, plus the
capability gates."""

from __future__ import annotations

import pytest

from domain.errors import ConfigError, GpuCapabilityTooLow, UnsupportedCombination
from domain.quant.backend_policy import (
    AUTO,
    DEEP_GEMM,
    MIN_CAPABILITY,
    check_capability,
)
from domain.quant.plan import QuantizationPlan
from tests.dispatching import decide_backends

HOPPER, BLACKWELL, AMPERE = (9, 0), (10, 0), (8, 0)


def plan(linear=None, moe=None, **kw) -> QuantizationPlan:
    return QuantizationPlan.from_presets(linear=linear, moe=moe, **kw)


# --- vLLM --------------------------------------------------------------------------------------


def test_vllm_requests_deep_gemm_for_fp8_block_linear_and_moe() -> None:
    d = decide_backends("vllm", plan("FP8_BLOCK", "FP8_BLOCK"), BLACKWELL)
    assert (d.linear.backend, d.moe.backend) == (DEEP_GEMM, DEEP_GEMM)
    assert d.requests_deep_gemm


def test_vllm_mxfp8_linear_falls_back_to_auto_but_moe_uses_deep_gemm() -> None:
    d = decide_backends("vllm", plan("MXFP8", "MXFP8"), BLACKWELL)
    assert d.linear.backend == AUTO and "no DeepGEMM kernel" in d.linear.reason
    assert d.moe.backend == DEEP_GEMM


def test_vllm_mxfp4_never_claims_deep_gemm() -> None:
    # Linear: no DeepGEMM MXFP4 kernel. Experts W4A4: the compressed-tensors method ignores
    # moe_backend. Experts W4A8: DeepGEMM would compute FP8 1x128 activations, not MXFP8.
    w4a4 = decide_backends("vllm", plan("MXFP4", "MXFP4"), BLACKWELL)
    w4a8 = decide_backends("vllm", plan(moe="MXFP4", moe_activation="mxfp8"), BLACKWELL)
    assert (w4a4.linear.backend, w4a4.moe.backend, w4a8.moe.backend) == (AUTO, AUTO, AUTO)
    assert "ignores moe_backend=deep_gemm" in w4a4.moe.reason and "FP8 1x128" in w4a8.moe.reason
    assert not w4a4.requests_deep_gemm and not w4a8.requests_deep_gemm


def test_vllm_nvfp4_weight_only_is_left_to_the_engine() -> None:
    # flashinfer_trtllm has no weight-only NVFP4 kernel: asking for it fails at vLLM's start-up.
    d = decide_backends("vllm", plan("NVFP4", "NVFP4", linear_activation="none", moe_activation="none"), BLACKWELL)
    assert (d.linear.backend, d.moe.backend) == (AUTO, AUTO)
    assert "weight-only" in d.moe.reason and not d.requests_deep_gemm


def test_vllm_fp8_block_weight_only_is_left_to_the_engine() -> None:
    d = decide_backends("vllm", plan("FP8_BLOCK", linear_activation="none"), HOPPER)
    assert d.linear.backend == AUTO and "W8A16" in d.linear.reason
    assert d.deep_gemm_e8m0 is None  # no DeepGEMM, no scale packing to turn off


def test_vllm_mixed_plan_decides_each_role_by_its_format() -> None:
    d = decide_backends("vllm", plan("FP8_BLOCK", "NVFP4", moe_activation="none"), BLACKWELL)
    assert (d.linear.backend, d.moe.backend) == (DEEP_GEMM, AUTO)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_no_deep_gemm_without_a_known_gpu(engine: str) -> None:
    d = decide_backends(engine, plan("FP8_BLOCK", "MXFP8" if engine == "vllm" else None), None)
    assert not d.requests_deep_gemm
    assert "capability unknown" in d.linear.reason
    assert any("E8M0 rule is not applied" in n for n in d.notes)


def test_bf16_plan_leaves_everything_automatic() -> None:
    for engine in ("vllm", "sglang"):
        d = decide_backends(engine, QuantizationPlan.bf16(), None)
        assert d.linear.is_auto and d.moe.is_auto and d.deep_gemm_e8m0 is None and d.notes == ()


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize(("linear", "moe"), [("FP8_BLOCK", "FP8_BLOCK"), ("MXFP8", "MXFP4"), ("NVFP4", "NVFP4")])
def test_opt_out_restores_automatic_selection_everywhere(engine: str, linear: str, moe: str) -> None:
    if engine == "sglang" and (linear, moe) == ("MXFP8", "MXFP4"):
        moe = "MXFP8"  # dispatch rule 6 forbids the pair on SGLang; the policy does not care
    d = decide_backends(engine, plan(linear, moe), BLACKWELL, opt_out=True)
    assert d.opted_out and d.linear.is_auto and d.moe.is_auto
    assert any("opt-out" in n for n in d.notes)


def test_hopper_fp8_block_disables_e8m0_packing() -> None:
    d = decide_backends("vllm", plan("FP8_BLOCK"), HOPPER)
    assert d.deep_gemm_e8m0 is False
    assert any("E8M0" in n for n in d.notes)


def test_hopper_fp8_block_disables_e8m0_even_with_opt_out() -> None:
    # The opt-out gives kernel choice back to the engine; the scale encoding stays a correctness rule.
    assert decide_backends("vllm", plan("FP8_BLOCK"), HOPPER, opt_out=True).deep_gemm_e8m0 is False


@pytest.mark.parametrize("cap", [BLACKWELL, None])
def test_e8m0_left_to_the_engine_off_hopper_or_when_unknown(cap) -> None:
    assert decide_backends("vllm", plan("FP8_BLOCK"), cap).deep_gemm_e8m0 is None


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("cap", [BLACKWELL, (12, 0)])
def test_blackwell_fp8_block_says_deep_gemm_requantizes_the_scales(engine: str, cap: tuple[int, int]) -> None:
    d = decide_backends(engine, plan("FP8_BLOCK"), cap)
    note = next(n for n in d.notes if "power-of-two" in n)
    assert f"SM{cap[0]}{cap[1]}" in note and "served bytes are not the exported ones" in note
    assert ("vllm 0.33.0" if engine == "vllm" else "sglang 0.5.23") in note
    assert not any("power-of-two" in n for n in decide_backends(engine, plan("FP8_BLOCK"), HOPPER).notes
                   if "E8M0 scale packing off" not in n)


def test_sglang_never_sets_e8m0() -> None:
    assert decide_backends("sglang", plan("FP8_BLOCK"), HOPPER).deep_gemm_e8m0 is None


# --- SGLang ------------------------------------------------------------------------------------


def test_sglang_pins_deep_gemm_for_fp8_block_linear_and_native_experts() -> None:
    ct = decide_backends("sglang", plan("FP8_BLOCK", "FP8_BLOCK"), BLACKWELL)
    native = decide_backends("sglang", plan("FP8_BLOCK", "FP8_BLOCK"), BLACKWELL, layout="native-fp8")
    mxfp8 = decide_backends("sglang", plan("MXFP8", "MXFP8", scale_name="weight_scale_inv"), BLACKWELL)
    assert (ct.linear.backend, native.moe.backend) == (DEEP_GEMM, DEEP_GEMM)
    assert (mxfp8.linear.backend, mxfp8.moe.backend) == (DEEP_GEMM, DEEP_GEMM)  # layout read from the scale name


def test_sglang_compressed_tensors_fp8_experts_are_not_pinned_to_deep_gemm() -> None:
    # CompressedTensorsW8A8Fp8MoE builds no DeepGEMM runner: the first forward would fail.
    d = decide_backends("sglang", plan(moe="FP8_BLOCK"), BLACKWELL)
    assert d.moe.backend == AUTO and "no DeepGEMM runner" in d.moe.reason


def test_sglang_leaves_nvfp4_and_mxfp4_to_the_engine() -> None:
    d = decide_backends("sglang", plan("NVFP4", "NVFP4", moe_activation="none"), BLACKWELL)
    assert d.linear.is_auto and d.moe.is_auto and "Marlin" in d.moe.reason
    assert decide_backends("sglang", plan(moe="MXFP4"), BLACKWELL).moe.is_auto


# --- capability gates ----------------------------------------------------------------------------


def test_fp8_block_needs_hopper() -> None:
    with pytest.raises(GpuCapabilityTooLow, match=r"rollout\.quantization\.linear = FP8_BLOCK needs a Hopper"):
        decide_backends("vllm", plan("FP8_BLOCK"), AMPERE)
    assert decide_backends("vllm", plan("FP8_BLOCK"), HOPPER).linear.backend == DEEP_GEMM


@pytest.mark.parametrize("fmt", ["MXFP8", "MXFP4", "NVFP4"])
def test_mx_and_nvfp4_need_blackwell(fmt: str) -> None:
    with pytest.raises(GpuCapabilityTooLow, match=rf"rollout\.quantization\.moe = {fmt} needs a Blackwell") as info:
        decide_backends("sglang", plan(moe=fmt), HOPPER)
    assert isinstance(info.value, UnsupportedCombination) and isinstance(info.value, ValueError)
    assert "FP8_BLOCK" in str(info.value)  # says what to do instead


def test_newer_gpus_pass_the_gates() -> None:
    assert len(check_capability(plan("MXFP8", "NVFP4"), (12, 0))) == 2


def test_unknown_capability_skips_the_gates_and_says_so() -> None:
    notes = check_capability(plan(moe="NVFP4"), None)
    assert notes and "not checked" in notes[0]


def test_engine_without_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.name"):
        decide_backends("trtllm", plan("FP8_BLOCK"), HOPPER)


def test_reasons_list_every_role_and_note() -> None:
    lines = decide_backends("vllm", plan("FP8_BLOCK", "NVFP4", moe_activation="none"), BLACKWELL).reasons()
    assert lines[0].startswith("linear: deep_gemm") and lines[1].startswith("moe: auto")
    assert any("SM100" in line for line in lines[2:])


# --- the composition root's builder: opt-out from configuration or environment -----------------


def test_bootstrap_reads_the_config_opt_out() -> None:
    from app.bootstrap import bootstrap

    on = bootstrap(environ={}).engines.backend_decision("vllm", plan("FP8_BLOCK"), HOPPER)
    off = bootstrap({"rollout": {"engine_kwargs": {"vllm": {"use_deep_gemm": False}}}},
                    environ={}).engines.backend_decision("vllm", plan("FP8_BLOCK"), HOPPER)
    assert on.linear.backend == DEEP_GEMM and not on.opted_out
    assert off.linear.is_auto and off.opted_out


@pytest.mark.parametrize(("value", "opted_out"), [("0", True), ("false", True), ("1", False), ("TRUE", False)])
def test_bootstrap_reads_the_environment_opt_out(value: str, opted_out: bool) -> None:
    from app.bootstrap import bootstrap

    d = bootstrap(environ={"VERL_ROLLOUT_USE_DEEP_GEMM": value}).engines.backend_decision("sglang", plan("FP8_BLOCK"), HOPPER)
    assert d.opted_out is opted_out and (d.linear.backend == DEEP_GEMM) is not opted_out


def test_bootstrap_rejects_values_that_are_not_switches() -> None:
    from app.bootstrap import bootstrap

    with pytest.raises(ConfigError, match="VERL_ROLLOUT_USE_DEEP_GEMM"):
        bootstrap(environ={"VERL_ROLLOUT_USE_DEEP_GEMM": "maybe"}).engines.deep_gemm_opt_out("vllm")
    with pytest.raises(ConfigError, match=r"rollout\.engine_kwargs\.vllm\.use_deep_gemm"):
        bootstrap({"rollout": {"engine_kwargs": {"vllm": {"use_deep_gemm": "no"}}}}, environ={})


# --- docs/engines.md's support matrix is the policy's ----------------------------------------


def _matrix_rows() -> list[list[str]]:
    import pathlib

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "engines.md").read_text()
    section = text.split("### Kernel backends by cell", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip().strip("`") for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| linear")]
    return rows


def _role(text: str) -> tuple[str | None, str | None]:
    """`NVFP4 none` -> ("NVFP4", "none"); `BF16` -> (None, None)."""
    fmt, _, act = text.partition(" ")
    return (None if fmt == "BF16" else fmt), (act or None)


def test_docs_backend_table_matches_the_dispatch_and_the_policy() -> None:
    from domain.errors import EngineCellUnsupported
    from tests.dispatching import DispatchInput, resolve

    rows = _matrix_rows()
    assert len(rows) >= 10
    rejected = 0
    for linear, moe, gpu, vllm, sglang, _why in rows:
        (lin, lin_act), (mo, mo_act) = _role(linear), _role(moe)
        p = plan(lin, mo, linear_activation=lin_act, moe_activation=mo_act)
        for engine, cell in (("vllm", vllm), ("sglang", sglang)):
            try:
                res = resolve(DispatchInput(engine=engine, requested=p))
            except EngineCellUnsupported:
                assert cell == "rejected", (linear, moe, engine)
                rejected += 1
                continue
            d = decide_backends(engine, res.plan, BLACKWELL, layout=res.layout)
            assert cell == f"{d.linear.backend} / {d.moe.backend}", (linear, moe, engine)
        need = max(MIN_CAPABILITY[f.name] for f in p.formats)
        assert gpu == f"SM{need[0]}{need[1]}+"
    assert rejected  # the table shows rejections too, and they are checked
