"""`refit doctor` against fake environments: missing packages, old versions, no GPU, old GPUs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import attrs
import pytest
import torch

from adapters.memory.environment import FixedEnvironmentProbe
from adapters.profiles import DISTRIBUTIONS
from adapters.system.probe import SystemProbe, installed_version
from app.cli.main import main
from app.config import load_config
from app.services.doctor import DoctorReport, diagnose, fused_forward_decision
from app.services.doctor_checks import Reason, Status
from domain.environment import EnvironmentSnapshot, GpuInfo, parse_version, version_at_least

H100 = GpuInfo("NVIDIA H100 80GB HBM3", (9, 0))
B200 = GpuInfo("NVIDIA B200", (10, 0))
A100 = GpuInfo("NVIDIA A100-SXM4-80GB", (8, 0))
FULL = {
    "torch": "2.13.0", "compressed-tensors": "0.20.1", "safetensors": "0.8.0", "megatron-core": "0.19.2",
    "transformer-engine": "2.8.0", "vllm": "0.33.0", "sglang": "0.5.23", "nvidia-modelopt": "0.47.0",
    "flash-linear-attention": "0.6.0", "causal-conv1d": None, "triton": "3.5.0", "torchao": "0.18.0",
    "transformers": "5.0.0",
}


def machine(gpus=(H100,), torch_cuda="12.8", nccl=True, environ=None, **packages) -> EnvironmentSnapshot:
    return EnvironmentSnapshot("3.11.7", {**FULL, **packages}, torch_cuda, gpus, nccl, environ or {}, "Linux")


CPU_ONLY = machine(gpus=(), torch_cuda=None, nccl=False, vllm=None, sglang=None, **{"transformer-engine": None})


def check(report: DoctorReport, name: str, area: str | None = None):
    found = [c for c in report.checks if c.name == name and (area is None or c.area == area)]
    assert len(found) == 1, f"expected one check {name!r} in {[c.name for c in report.checks]}"
    return found[0]


# --- versions ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("0.19.2", (0, 19, 2)), ("2.13.0+cpu", (2, 13, 0)), ("0.6.0rc1", (0, 6, 0)), ("v1.2", (1, 2)),
    ("2.10.0.dev20250101", (2, 10, 0)), ("unknown", None), (None, None),
])
def test_parse_version(text, expected) -> None:
    assert parse_version(text) == expected


def test_version_at_least() -> None:
    assert version_at_least("0.18", (0, 18)) and version_at_least("0.18.0", (0, 18))
    assert version_at_least("0.19.2", (0, 18)) and version_at_least("1.0", (0, 18))
    assert not version_at_least("0.17.9", (0, 18))
    assert not version_at_least(None, (0, 18)) and not version_at_least("unknown", (0, 1))


# --- machine checks ----------------------------------------------------------------------------


def test_a_complete_hopper_machine() -> None:
    r = diagnose(machine())
    assert check(r, "gpu").status is Status.OK and "SM90" in check(r, "gpu").detail
    assert check(r, "FP8_BLOCK kernels").status is Status.OK
    for preset in ("MXFP8", "MXFP4", "NVFP4"):  # Blackwell kernels
        c = check(r, f"{preset} kernels")
        assert (c.status, c.reason) == (Status.UNAVAILABLE, Reason.GPU_TOO_OLD)
        assert "Blackwell (SM100)" in c.detail and "SM90" in c.detail
    assert check(r, "vllm", "engines").status is Status.OK
    assert check(r, "nccl").status is Status.OK
    assert check(r, "TE fp8 blockwise").status is Status.OK
    assert check(r, "TE fp4 nvfp4").reason is Reason.GPU_TOO_OLD
    assert r.fused_forward.mode == "hook"
    assert r.config_ok is None


def test_blackwell_serves_every_preset() -> None:
    r = diagnose(machine(gpus=(B200, B200)))
    assert all(check(r, f"{p} kernels").status is Status.OK for p in ("FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4"))


def test_mixed_gpus_are_judged_by_the_oldest() -> None:
    r = diagnose(machine(gpus=(B200, H100)))
    assert check(r, "NVFP4 kernels").reason is Reason.GPU_TOO_OLD


def test_no_gpu() -> None:
    r = diagnose(CPU_ONLY)
    gpu = check(r, "gpu")
    assert (gpu.status, gpu.reason) == (Status.WARNING, Reason.NO_GPU) and "CPU build" in gpu.detail
    for preset in ("FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4"):
        assert check(r, f"{preset} kernels").reason is Reason.NO_GPU
    assert check(r, "nccl").reason is Reason.NO_GPU
    assert check(r, "codecs").status is Status.OK  # export runs on CPU
    assert check(r, "reference").status is Status.OK
    assert check(r, "gloo").status is Status.OK
    assert "need CUDA" in check(r, "nvidia-modelopt").detail and "need CUDA" not in check(diagnose(machine()),
                                                                                          "nvidia-modelopt").detail
    assert "CUDA 12.4 but sees no GPU" in check(diagnose(attrs.evolve(CPU_ONLY, torch_cuda="12.4")), "gpu").detail


def test_installed_engine_without_gpu_is_unavailable() -> None:
    r = diagnose(machine(gpus=()))
    c = check(r, "vllm", "engines")
    assert (c.status, c.reason) == (Status.UNAVAILABLE, Reason.NO_GPU) and "0.33.0" in c.detail


def test_engine_version_other_than_the_pinned_one_is_a_warning() -> None:
    from adapters.vllm.profile import PINNED_VLLM

    c = check(diagnose(machine(vllm="0.11.0")), "vllm", "engines")
    assert (c.status, c.reason) == (Status.WARNING, Reason.VERSION_DIFFERS)
    assert "0.11.0" in c.detail and PINNED_VLLM in c.detail and f"pins vllm {PINNED_VLLM}" in c.fix


def test_missing_packages() -> None:
    r = diagnose(machine(vllm=None, sglang=None, **{"megatron-core": None, "nvidia-modelopt": None,
                                                    "transformer-engine": None}))
    for name, area in (("vllm", "engines"), ("sglang", "engines"), ("megatron-core", "trainer"),
                       ("nvidia-modelopt", "qat"), ("transformer-engine", "trainer")):
        c = check(r, name, area)
        assert (c.status, c.reason) == (Status.UNAVAILABLE, Reason.PACKAGE_MISSING), name
        assert c.fix
    assert not [c for c in r.checks if c.name.startswith("TE ")]  # no recipes without TE
    assert not [c for c in r.checks if c.name == "packed GDN"]
    ff = check(r, "fused forward")
    assert (ff.status, ff.reason) == (Status.UNAVAILABLE, Reason.PACKAGE_MISSING)
    assert r.fused_forward.mode is None


def test_old_versions() -> None:
    r = diagnose(machine(python="3.10.12", torch="2.5.1", **{"compressed-tensors": "0.12.2",
                                                             "nvidia-modelopt": "0.33.0"}))
    for name in ("torch", "compressed-tensors", "nvidia-modelopt"):
        c = check(r, name)
        assert (c.status, c.reason) == (Status.UNAVAILABLE, Reason.VERSION_TOO_OLD), name
        assert "older than" in c.detail and ">=" in c.fix
    # python is not a package: the snapshot's python field is what counts
    assert check(diagnose(attrs.evolve(machine(), python="3.10.12")), "python").reason is Reason.VERSION_TOO_OLD


def test_old_megatron_patches_gdn_and_picks_legacy() -> None:
    r = diagnose(machine(**{"megatron-core": "0.16.0"}))
    gdn = check(r, "packed GDN")
    assert gdn.status is Status.OK and "fla 0.6.0" in gdn.detail
    assert r.fused_forward.mode == "legacy" and "0.16.0" in r.fused_forward.detail
    no_fla = check(diagnose(machine(**{"megatron-core": "0.16.0", "flash-linear-attention": None})), "packed GDN")
    assert (no_fla.status, no_fla.reason) == (Status.UNAVAILABLE, Reason.PACKAGE_MISSING)
    cpu = check(diagnose(attrs.evolve(CPU_ONLY, packages={**FULL, "megatron-core": "0.16.0"})), "packed GDN")
    assert cpu.status is Status.OK and "reference" in cpu.detail


# --- fused forward ----------------------------------------------------------------------------


@pytest.mark.parametrize(("mcore", "config", "env", "mode", "source"), [
    ("0.19.2", None, None, "hook", "default"),
    ("0.17.0", None, None, "legacy", "default"),
    ("0.19.2", "legacy", None, "legacy", "actor.fused_forward"),
    ("0.19.2", None, "0", "legacy", "VERL_FUSED_USE_OP_HOOK"),
    ("0.19.2", "auto", "0", "hook", "actor.fused_forward"),  # the configuration wins over the variable
    ("0.19.2", True, None, "hook", "actor.fused_forward"),
    ("0.17.0", "hook", None, None, "actor.fused_forward"),  # hook required, not there
])
def test_fused_forward_decision(mcore, config, env, mode, source) -> None:
    snap = machine(environ={"VERL_FUSED_USE_OP_HOOK": env} if env is not None else {}, **{"megatron-core": mcore})
    d = fused_forward_decision(snap, config)
    assert (d.mode, d.source) == (mode, source)
    if mode is None:
        assert d.reason is Reason.VERSION_TOO_OLD and "FusedHookUnavailable" in d.detail


def test_bad_fused_forward_value_is_a_config_error() -> None:
    d = fused_forward_decision(machine(), "sometimes")
    assert d.mode is None and d.reason is Reason.CONFIG and "FusedForwardModeError" in d.detail
    env = fused_forward_decision(machine(environ={"VERL_FUSED_USE_OP_HOOK": "maybe"}))
    assert env.mode is None and "VERL_FUSED_USE_OP_HOOK" in env.detail


# --- configurations ---------------------------------------------------------------------------


def cfg(*overrides: str):
    return load_config(None, list(overrides))


def test_config_that_runs_here() -> None:
    r = diagnose(machine(), cfg("rollout.name=vllm", "rollout.quantization.linear=FP8_BLOCK"))
    assert r.config_ok is True
    assert check(r, "kernels").status is Status.OK and "deep_gemm" in check(r, "kernels").detail


def test_config_needs_a_newer_gpu() -> None:
    r = diagnose(machine(gpus=(A100,)), cfg("rollout.name=vllm", "rollout.quantization.linear=FP8_BLOCK"))
    k = check(r, "kernels")
    assert (k.status, k.reason) == (Status.ERROR, Reason.GPU_TOO_OLD) and "GpuCapabilityTooLow" in k.detail
    assert r.config_ok is False


def test_config_engine_missing_or_no_gpu() -> None:
    conf = cfg("rollout.name=sglang", "rollout.quantization.moe=MXFP8")  # served natively by SGLang
    missing = diagnose(machine(sglang=None), conf)
    engine = check(missing, "rollout.name")
    assert (engine.status, engine.reason) == (Status.ERROR, Reason.PACKAGE_MISSING) and missing.config_ok is False
    no_gpu = diagnose(machine(gpus=()), conf)
    assert check(no_gpu, "rollout.name").reason is Reason.NO_GPU and check(no_gpu, "kernels").reason is Reason.NO_GPU


def test_reference_config_runs_on_cpu() -> None:
    r = diagnose(CPU_ONLY, cfg("rollout.quantization.linear=NVFP4", "rollout.quantization.moe=NVFP4"))
    assert r.config_ok is True and not [c for c in r.checks if c.name == "kernels"]


def test_config_rejected_by_a_dispatch_rule() -> None:
    r = diagnose(machine(), cfg("rollout.name=trtllm", "rollout.quantization.linear=FP8_BLOCK"))
    plan = check(r, "plan")
    assert (plan.status, plan.reason) == (Status.ERROR, Reason.CONFIG) and "EngineRejectsQuantization" in plan.detail
    assert r.config_ok is False


def test_config_hook_required_on_old_megatron() -> None:
    r = diagnose(machine(**{"megatron-core": "0.15.0"}), cfg("actor.fused_forward=hook"))
    ff = check(r, "fused forward")
    assert (ff.status, ff.reason) == (Status.ERROR, Reason.VERSION_TOO_OLD) and r.config_ok is False


def test_config_syncing_over_nccl_without_a_gpu_cannot_run() -> None:
    # the transport row said "nccl unavailable (no GPU)" while the verdict said "runs here"
    r = diagnose(CPU_ONLY, cfg("rollout.checkpoint_engine.backend=nccl"))
    sync = check(r, "rollout.checkpoint_engine.backend")
    assert (sync.status, sync.reason) == (Status.ERROR, Reason.NO_GPU) and r.config_ok is False
    assert diagnose(machine(), cfg("rollout.checkpoint_engine.backend=nccl")).config_ok is True
    assert diagnose(CPU_ONLY, cfg("rollout.checkpoint_engine.backend=gloo")).config_ok is True


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_config_with_a_trainer_strategy_without_an_adapter_cannot_run(strategy: str) -> None:
    r = diagnose(machine(), cfg(f"actor.strategy={strategy}"))
    row = check(r, "actor.strategy")
    assert (row.status, row.reason) == (Status.ERROR, Reason.NOT_SUPPORTED) and r.config_ok is False


def test_config_with_the_megatron_strategy_needs_megatron_core() -> None:
    assert diagnose(machine(), cfg("actor.strategy=megatron")).config_ok is True
    missing = diagnose(machine(**{"megatron-core": None}), cfg("actor.strategy=megatron"))
    row = check(missing, "actor.strategy")
    assert (row.status, row.reason) == (Status.ERROR, Reason.PACKAGE_MISSING) and missing.config_ok is False


# --- probes, bootstrap and CLI ------------------------------------------------------------------


def test_system_probe_reads_metadata_without_importing() -> None:
    before = set(sys.modules)
    snap = SystemProbe(environ={"VERL_FUSED_USE_OP_HOOK": "1"}).snapshot()
    assert set(snap.packages) == set(DISTRIBUTIONS)
    assert snap.version("torch") == torch.__version__
    assert snap.torch_cuda == torch.version.cuda
    assert len(snap.gpus) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert snap.environ == {"VERL_FUSED_USE_OP_HOOK": "1"}
    new = set(sys.modules) - before
    assert not [m for m in new if m.split(".")[0] in ("transformer_engine", "vllm", "sglang", "megatron", "fla")]


def test_system_probe_version_seam() -> None:
    snap = SystemProbe(version_of=lambda names: "9.9" if names[0] == "vllm" else None).snapshot()
    assert snap.version("vllm") == "9.9" and snap.version("torch") is None
    assert installed_version(("no-such-distribution-rl-refit",)) is None


def test_fixed_probe_round_trips_the_json_snapshot() -> None:
    snap = machine(gpus=(H100, B200), environ={"VERL_FUSED_USE_OP_HOOK": "0"})
    assert FixedEnvironmentProbe.from_dict(json.loads(json.dumps(snap.to_dict()))).snapshot() == snap


def test_gpu_capability_is_validated() -> None:
    with pytest.raises(ValueError, match="capability"):
        GpuInfo("x", (9,))


@pytest.fixture()
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "doctor.json"
    path.write_text(json.dumps(diagnose(machine(gpus=(A100,))).to_dict()))
    return path


def test_cli_json_on_a_saved_environment(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--environment", str(saved), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["environment"]["gpus"] == [{"name": A100.name, "capability": [8, 0]}]
    assert out["config_ok"] is None
    by_name = {c["name"]: c for c in out["checks"]}
    assert by_name["FP8_BLOCK kernels"]["reason"] == "GPU too old"
    assert out["fused_forward"]["mode"] == "hook"


def test_cli_exit_code_follows_the_config(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--environment", str(saved), "rollout.name=vllm", "rollout.quantization.linear=FP8_BLOCK"]) == 1
    text = capsys.readouterr().out
    assert "cannot run here" in text and "GPU too old" in text
    assert main(["doctor", "--environment", str(saved), "rollout.quantization.linear=FP8_BLOCK"]) == 0


def test_cli_deep_gemm_opt_out(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(saved.read_text())
    data["environment"]["gpus"] = [{"name": H100.name, "capability": [9, 0]}]
    data["environment"]["environ"] = {"VERL_ROLLOUT_USE_DEEP_GEMM": "0"}
    saved.write_text(json.dumps(data))
    argv = ["doctor", "--environment", str(saved), "--json", "rollout.name=vllm", "rollout.quantization.linear=FP8_BLOCK"]
    assert main(argv) == 0
    kernels = next(c for c in json.loads(capsys.readouterr().out)["checks"] if c["name"] == "kernels")
    assert "deep_gemm" not in kernels["detail"] and "opt-out" in kernels["detail"]


def test_cli_table_on_this_machine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    assert "support matrix on this machine" in text and f"torch {torch.__version__}" in text
    assert "fused forward: requested auto" in text


def test_cli_bad_environment_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["doctor", "--environment", str(bad)]) == 2
    assert "ConfigError: --environment" in capsys.readouterr().err
