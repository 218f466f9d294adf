"""The vLLM CPU emulation plugin's decision (adapters.vllm.cpu_emulation), its configuration path
from rollout.engine_kwargs.vllm.cpu_emulation into the engine's environment, and the short
engine-start errors (adapters.vllm.launcher.root_cause) on real vLLM logs. No vLLM needed: what runs
inside a real engine is in tests/vllm/test_cpu_emulation.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapters.memory.environment import FixedEnvironmentProbe
from adapters.system.probe import VLLM_KERNEL_LABELS, vllm_cpu_kernels
from adapters.vllm.cpu_emulation import ENV_VAR, FORMATS, emulated_formats, parse_mode
from adapters.vllm.factory import vllm_environment
from adapters.vllm.launcher import root_cause
from app.bootstrap import bootstrap
from app.services.doctor_checks import Status, engine_cpu_checks
from domain.environment import EnvironmentSnapshot
from domain.errors import ConfigError
from domain.quant.plan import QuantizationPlan
from tests.dispatching import decide_backends

LOGS = Path(__file__).resolve().parents[1] / "data" / "vllm_logs"
NO_AMX = {"FP8_BLOCK": "CPUFp8BlockScaledMMKernel requires AMX tile support", "MXFP8": "none registered",
          "MXFP4": "none registered", "NVFP4": "none registered"}
WITH_AMX = {**NO_AMX, "FP8_BLOCK": None}


def test_inactive_on_a_platform_that_is_not_the_cpu_whatever_the_mode() -> None:
    for mode in ("auto", "on", "off"):
        assert emulated_formats(mode, on_cpu=False, native=NO_AMX) == ()


def test_off_emulates_nothing_on_the_cpu() -> None:
    assert emulated_formats("off", on_cpu=True, native=NO_AMX) == ()


def test_auto_emulates_only_what_has_no_native_kernel_by_vllms_own_reasons() -> None:
    assert emulated_formats("auto", on_cpu=True, native=NO_AMX) == ("FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4")
    # with AMX, vLLM's own FP8 block kernel is supported: it is left alone
    assert emulated_formats("auto", on_cpu=True, native=WITH_AMX) == ("MXFP8", "MXFP4", "NVFP4")


def test_on_emulates_every_format_even_where_a_native_kernel_exists() -> None:
    assert emulated_formats("on", on_cpu=True, native=WITH_AMX) == tuple(f.name for f in FORMATS)


@pytest.mark.parametrize(("value", "mode"), [(None, "auto"), ("", "auto"), ("ON", "on"), (" off ", "off")])
def test_modes_parse(value: str | None, mode: str) -> None:
    assert parse_mode(value) == mode


def test_an_unknown_mode_is_refused_naming_the_variable() -> None:
    with pytest.raises(ValueError, match=ENV_VAR):
        parse_mode("sometimes")


def test_the_mode_reaches_the_engines_environment() -> None:
    decision = decide_backends("vllm", QuantizationPlan.from_presets("FP8_BLOCK", None), None)
    assert vllm_environment(decision, colocated=True)[ENV_VAR] == "auto"
    assert vllm_environment(decision, colocated=False, cpu_emulation="off")[ENV_VAR] == "off"


def test_the_configuration_key_takes_only_the_three_modes() -> None:
    assert bootstrap(overrides=["rollout.engine_kwargs.vllm.cpu_emulation=off"]).config.rollout.engine_kwargs.vllm.cpu_emulation == "off"
    with pytest.raises(ConfigError, match=r"rollout\.engine_kwargs\.vllm\.cpu_emulation"):
        bootstrap(overrides=["rollout.engine_kwargs.vllm.cpu_emulation=maybe"])


def test_a_kernel_selection_failure_is_one_line_with_every_reason() -> None:
    cause = root_cause((LOGS / "no_fp8_block_kernel.log").read_text())
    assert cause == (
        "ValueError: Failed to find a kernel that can implement the ScaledMM linear layer. Reasons:; "
        "CPUFp8W8A8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or newer)..; "
        "CPUFp8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or newer)..")


def test_the_root_cause_is_the_workers_error_not_vllms_wrapper() -> None:
    text = (LOGS / "moe_backend_none.log").read_text()
    assert "Engine core initialization failed" in text  # the wrapper is there, after the cause
    assert root_cause(text) == "ValueError: Unsupported FP8 MoE backend: NONE"


def test_a_log_without_an_exception_has_no_root_cause() -> None:
    assert root_cause("INFO starting\nWARNING slow\n") is None


def _snapshot(kernels: dict[str, object] | None) -> EnvironmentSnapshot:
    """A snapshot whose probe found `kernels`, labelled as the vLLM probe labels its answers."""
    labelled = None if kernels is None else {**VLLM_KERNEL_LABELS, **kernels}
    return EnvironmentSnapshot(python="3.11.7", engine_cpu_kernels=labelled)


def test_doctor_says_which_of_vllms_cpu_kernels_this_machine_has_and_what_is_emulated() -> None:
    rows = {c.name: c for c in engine_cpu_checks(_snapshot({
        "mode": "auto", "emulated": ["MXFP8"],
        "native": {"FP8_BLOCK": None, "MXFP8": "vLLM registers no MXFP8 linear kernel for the CPU platform"}}))}
    assert rows["FP8_BLOCK"].status is Status.OK and "vLLM's own" in rows["FP8_BLOCK"].detail
    assert rows["MXFP8"].status is Status.WARNING
    assert "emulated matmul (cpu_emulation=auto)" in rows["MXFP8"].detail and "no MXFP8" in rows["MXFP8"].detail


def test_doctor_with_emulation_off_lists_the_formats_vllm_cannot_serve_here() -> None:
    (row,) = engine_cpu_checks(_snapshot({"mode": "off", "emulated": [], "native": {"FP8_BLOCK": "requires AMX"}}))
    assert row.status is Status.UNAVAILABLE and "requires AMX" in row.detail and "cpu_emulation=auto" in row.fix


def test_doctor_has_no_vllm_cpu_rows_without_a_vllm_environment_and_says_why_a_probe_failed() -> None:
    assert engine_cpu_checks(_snapshot(None)) == []
    (row,) = engine_cpu_checks(_snapshot({"error": "no module named vllm"}))
    assert row.status is Status.WARNING and "no module named vllm" in row.detail
    assert row.area == "rollout kernels (vLLM CPU)" and ".venv-vllm" in row.fix  # the probe's labels


def test_the_probe_of_an_environment_without_vllm_reports_its_error(tmp_path: Path) -> None:
    assert vllm_cpu_kernels(None, "auto") is None and vllm_cpu_kernels(str(tmp_path / "absent"), "auto") is None
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named vllm' >&2\nexit 1\n")
    fake.chmod(0o755)
    said: list[str] = []
    assert vllm_cpu_kernels(str(tmp_path / "absent"), "auto", said.append) is None and said == []  # nothing to ask
    found = vllm_cpu_kernels(str(fake), "auto", said.append)
    assert found is not None and "exited 1: ModuleNotFoundError: No module named vllm" in found["error"]
    assert said == [f"asking {fake} for vLLM's CPU kernels (it imports vLLM, which takes seconds) ..."]  # said first


def test_a_saved_snapshot_keeps_the_vllm_cpu_kernels() -> None:
    kernels = {"mode": "on", "emulated": ["FP8_BLOCK"], "native": {"FP8_BLOCK": None}}
    again = FixedEnvironmentProbe.from_dict(_snapshot(kernels).to_dict()).snapshot()
    assert again.engine_cpu_kernels == {**VLLM_KERNEL_LABELS, **kernels}


def test_a_snapshot_saved_under_the_former_key_keeps_the_vllm_cpu_kernels() -> None:
    kernels = {"mode": "on", "emulated": ["FP8_BLOCK"], "native": {"FP8_BLOCK": None}}
    saved = _snapshot(None).to_dict()
    del saved["engine_cpu_kernels"]
    saved["vllm_cpu_kernels"] = kernels  # `refit doctor --json` before the field was named for every engine
    assert FixedEnvironmentProbe.from_dict(saved).snapshot().engine_cpu_kernels == kernels
