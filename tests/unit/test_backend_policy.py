"""Backend policy (ARCHITECTURE.md section 5): one test per rule, plus the capability gates."""

from __future__ import annotations

import pytest

from domain.errors import ConfigError, GpuCapabilityTooLow, UnsupportedCombination
from domain.quant.backend_policy import (
    AUTO,
    DEEP_GEMM,
    FLASHINFER_CUTLASS,
    FLASHINFER_TRTLLM,
    MIN_CAPABILITY,
    check_capability,
    decide_backends,
)
from domain.quant.plan import QuantizationPlan

HOPPER, BLACKWELL, AMPERE = (9, 0), (10, 0), (8, 0)


def plan(linear=None, moe=None, **kw) -> QuantizationPlan:
    return QuantizationPlan.from_presets(linear=linear, moe=moe, **kw)


# --- vLLM --------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["FP8_BLOCK", "MXFP4"])
def test_vllm_requests_deep_gemm_for_linear_and_moe(fmt: str) -> None:
    d = decide_backends("vllm", plan(fmt, fmt), BLACKWELL)
    assert (d.linear.backend, d.moe.backend) == (DEEP_GEMM, DEEP_GEMM)
    assert d.requests_deep_gemm


def test_vllm_mxfp8_linear_falls_back_to_auto_but_moe_uses_deep_gemm() -> None:
    d = decide_backends("vllm", plan("MXFP8", "MXFP8"), BLACKWELL)
    assert d.linear.backend == AUTO and "no DeepGEMM kernel" in d.linear.reason
    assert d.moe.backend == DEEP_GEMM


def test_vllm_nvfp4_per_token_stays_on_flashinfer_trtllm() -> None:
    d = decide_backends("vllm", plan("NVFP4", "NVFP4"), BLACKWELL)
    assert (d.linear.backend, d.moe.backend) == (FLASHINFER_TRTLLM, FLASHINFER_TRTLLM)
    assert not d.requests_deep_gemm


def test_vllm_nvfp4_static_activations_use_flashinfer_cutlass() -> None:
    d = decide_backends("vllm", plan(moe="NVFP4", moe_activation="nvfp4_static"), BLACKWELL)
    assert d.moe.backend == FLASHINFER_CUTLASS
    assert d.linear.backend == AUTO  # BF16 dense layers: nothing to choose


def test_vllm_mixed_plan_decides_each_role_by_its_format() -> None:
    d = decide_backends("vllm", plan("FP8_BLOCK", "NVFP4"), BLACKWELL)
    assert (d.linear.backend, d.moe.backend) == (DEEP_GEMM, FLASHINFER_TRTLLM)


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


def test_sglang_never_sets_e8m0() -> None:
    assert decide_backends("sglang", plan("FP8_BLOCK"), HOPPER).deep_gemm_e8m0 is None


# --- SGLang ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("linear", "moe"), [("FP8_BLOCK", "FP8_BLOCK"), ("MXFP8", "MXFP8")])
def test_sglang_pins_deep_gemm_for_fp8_and_mxfp8(linear: str, moe: str) -> None:
    d = decide_backends("sglang", plan(linear, moe), BLACKWELL)
    assert (d.linear.backend, d.moe.backend) == (DEEP_GEMM, DEEP_GEMM)


def test_sglang_pins_deep_gemm_for_mxfp4_experts() -> None:
    d = decide_backends("sglang", plan(moe="MXFP4"), BLACKWELL)
    assert d.moe.backend == DEEP_GEMM


def test_sglang_leaves_nvfp4_to_the_engine() -> None:
    d = decide_backends("sglang", plan("NVFP4", "NVFP4", moe_activation="nvfp4_static"), BLACKWELL)
    assert d.linear.is_auto and d.moe.is_auto
    assert "left to SGLang" in d.moe.reason


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
    lines = decide_backends("vllm", plan("FP8_BLOCK", "NVFP4"), BLACKWELL).reasons()
    assert lines[0].startswith("linear: deep_gemm") and lines[1].startswith("moe: flashinfer_trtllm")
    assert any("SM100" in line for line in lines[2:])


# --- the composition root's builder: opt-out from configuration or environment -----------------


def test_bootstrap_reads_the_config_opt_out() -> None:
    from app.bootstrap import bootstrap

    on = bootstrap(environ={}).backend_decision("vllm", plan("FP8_BLOCK"), HOPPER)
    off = bootstrap({"rollout": {"engine_kwargs": {"vllm": {"use_deep_gemm": False}}}},
                    environ={}).backend_decision("vllm", plan("FP8_BLOCK"), HOPPER)
    assert on.linear.backend == DEEP_GEMM and not on.opted_out
    assert off.linear.is_auto and off.opted_out


@pytest.mark.parametrize(("value", "opted_out"), [("0", True), ("false", True), ("1", False), ("TRUE", False)])
def test_bootstrap_reads_the_environment_opt_out(value: str, opted_out: bool) -> None:
    from app.bootstrap import bootstrap

    d = bootstrap(environ={"VERL_ROLLOUT_USE_DEEP_GEMM": value}).backend_decision("sglang", plan("FP8_BLOCK"), HOPPER)
    assert d.opted_out is opted_out and (d.linear.backend == DEEP_GEMM) is not opted_out


def test_bootstrap_rejects_values_that_are_not_switches() -> None:
    from app.bootstrap import bootstrap

    with pytest.raises(ConfigError, match="VERL_ROLLOUT_USE_DEEP_GEMM"):
        bootstrap(environ={"VERL_ROLLOUT_USE_DEEP_GEMM": "maybe"}).deep_gemm_opt_out("vllm")
    with pytest.raises(ConfigError, match=r"rollout\.engine_kwargs\.vllm\.use_deep_gemm"):
        bootstrap({"rollout": {"engine_kwargs": {"vllm": {"use_deep_gemm": "no"}}}}, environ={})


# --- docs/engines.md's support matrix is the policy's ----------------------------------------


def _matrix_rows() -> list[list[str]]:
    import pathlib

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "engines.md").read_text()
    section = text.split("### Support matrix", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| linear")]
    return rows


def test_docs_support_matrix_matches_the_policy() -> None:
    from domain.errors import EngineRejectsQuantization
    from domain.quant.dispatch import check_sglang

    rows = _matrix_rows()
    assert len(rows) >= 10
    for linear, moe, act, gpu, vllm, sglang, _why in rows:
        lin, mo = (None if linear == "BF16" else linear), (None if moe == "BF16" else moe)
        kw = {}
        if act != "default":
            kw["linear_activation" if mo is None else "moe_activation"] = act
        p = plan(lin, mo, **kw)
        for engine, cell in (("vllm", vllm), ("sglang", sglang)):
            try:
                check_sglang(engine, p)
            except EngineRejectsQuantization:
                assert cell == "rejected", (linear, moe, act, engine)
                continue
            d = decide_backends(engine, p, BLACKWELL)
            assert cell == f"{d.linear.backend} / {d.moe.backend}", (linear, moe, act, engine)
        need = max(MIN_CAPABILITY[f.name] for f in p.formats)
        assert gpu == f"SM{need[0]}{need[1]}+"
