"""The composition root builds a vLLM engine in either deployment shape from the configuration:
what it starts, with which arguments and environment, and what it refuses (without starting vLLM:
the vLLM server and the in-process LLM are replaced by recorders)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from app.bootstrap import bootstrap
from domain.errors import ConfigError

BASE = ["rollout.name=vllm", "reference.model=micro-moe", "rollout.quantization.linear=FP8_BLOCK",
        "rollout.quantization.moe=FP8_BLOCK", "rollout.engine_kwargs.vllm.engine_args={enforce_eager: true}",
        "rollout.engine_kwargs.vllm.environment={VLLM_CPU_KVCACHE_SPACE: 1}"]


class Started:
    """Records each vLLM server the factory starts (adapters.vllm.launcher.start_owned) and each
    attach to one (adapters.vllm.attached.attach), instead of starting anything."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.attached: list[dict[str, Any]] = []

    def start(self, python: str, engine_kwargs: dict[str, Any], **kw: Any) -> object:
        self.calls.append({"python": python, "kwargs": dict(engine_kwargs), **kw})
        return SimpleNamespace(closed=False)

    def attach(self, control: Any, expected: Any, **kw: Any) -> object:
        self.attached.append({"control": control, "expected": expected, **kw})
        return SimpleNamespace(control=control, expected=expected, settings=kw["settings"], close=lambda: None)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> Started:
        from adapters.vllm import attached, launcher

        monkeypatch.setattr(launcher, "start_owned", self.start)
        monkeypatch.setattr(attached, "attach", self.attach)
        return self


def test_disaggregated_starts_a_vllm_server_without_vllm_here(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    started = Started().install(monkeypatch)
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\n")
    fake_python.chmod(0o755)  # the server's python must be one that runs
    services = bootstrap(overrides=[*BASE, "rollout.deployment=disaggregated",
                                    f"rollout.engine_kwargs.vllm.python={fake_python}"])
    engine = services.rollout_engine()
    (call,) = started.calls
    assert call["python"] == str(fake_python)
    kwargs = call["kwargs"]
    assert kwargs["load_format"] == "dummy" and kwargs["enforce_eager"] is True
    assert kwargs["quantization"] == "compressed-tensors"
    assert kwargs["hf_overrides"]["quantization_config"]["config_groups"]
    config = json.loads((Path(kwargs["model"]) / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_experts"] == 4
    env = call["env"]
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert env["VLLM_LOGGING_STREAM"] == "ext://sys.stderr"
    if services.engines.backend_decision("vllm", services.plan).capability is None:
        assert "VLLM_USE_DEEP_GEMM" not in env  # no GPU capability known: no DeepGEMM request
    # the server it started is attached to as a user's server is, and probed for this plan and model
    (attached,) = started.attached
    assert engine.control is attached["control"]  # type: ignore[attr-defined]
    assert attached["expected"].model == kwargs["model"] and attached["expected"].quantization == "compressed-tensors"
    assert attached["settings"]["transport"] == "shm" and attached["owned_dirs"] == (kwargs["model"],)
    json.dumps(kwargs)  # plain values only: they become the server's flags


def test_colocated_needs_vllm_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    services = bootstrap(overrides=[*BASE, "rollout.deployment=colocated"])
    with pytest.raises(ModuleNotFoundError, match=r"rollout\.name=vllm: .*needs vllm"):
        services.rollout_engine()


def test_engines_without_a_remote_form_refuse_the_disaggregated_shape() -> None:
    services = bootstrap(overrides=["rollout.name=sglang", "rollout.deployment=disaggregated"])
    with pytest.raises(ConfigError, match=r"rollout\.deployment.*sglang runs colocated only"):
        services.rollout_engine()


def test_a_bad_deployment_is_named() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.deployment.*valid: colocated, disaggregated"):
        bootstrap(overrides=["rollout.deployment=remote"])


def test_the_engine_hosts_python(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from adapters.vllm.interpreter import vllm_python

    services = bootstrap(overrides=BASE, environ={"RL_REFIT_VLLM_PYTHON": "/opt/vllm/bin/python"})
    assert services.engines.server_python("vllm") == "/opt/vllm/bin/python"
    configured = bootstrap(overrides=[*BASE, "rollout.engine_kwargs.vllm.python=/srv/py"],
                           environ={"RL_REFIT_VLLM_PYTHON": "/opt/vllm/bin/python"})
    assert configured.engines.server_python("vllm") == "/srv/py"  # the configuration before the environment
    monkeypatch.chdir(tmp_path)
    local = tmp_path / ".venv-vllm" / "bin" / "python"
    local.parent.mkdir(parents=True)
    local.write_text("")
    assert bootstrap(overrides=BASE, environ={}).engines.server_python("vllm") == str(local)
    local.unlink()
    assert vllm_python(None, roots=[tmp_path, tmp_path / "nowhere"]) == sys.executable


@pytest.mark.parametrize(("key", "value", "match"), [
    ("rollout.verify.batch", "0", "must be 1 or more"),
    ("rollout.verify.seq_len", "1", "must be 2 or more"),
    ("rollout.verify.max_abs_logp_diff", "-1", "must be 0 or more"),
    ("rollout.engine_kwargs.vllm.start_timeout_s", "0", "positive number of seconds"),
])
def test_new_keys_are_checked(key: str, value: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        bootstrap(overrides=[f"{key}={value}"])


def _disaggregated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *overrides: str) -> tuple[Any, Started]:
    started = Started().install(monkeypatch)
    fake_python = tmp_path / "python"
    fake_python.write_text("#!/bin/sh\n")
    fake_python.chmod(0o755)
    services = bootstrap(overrides=[*BASE, "rollout.deployment=disaggregated",
                                    f"rollout.engine_kwargs.vllm.python={fake_python}", *overrides])
    return services, started


def test_an_engine_asked_for_another_plan_is_configured_for_that_plan(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    from domain.quant.plan import QuantizationPlan

    services, started = _disaggregated(monkeypatch, tmp_path)  # the configuration says FP8_BLOCK
    # a refit service for BF16 streams BF16 tensors: its engine must be started for BF16, not FP8
    service = services.refit_service(plan=QuantizationPlan.bf16())
    assert service.plan == QuantizationPlan.bf16()
    (bf16,) = started.calls
    assert "quantization" not in bf16["kwargs"]
    assert (bf16["kwargs"].get("hf_overrides") or {}).get("quantization_config") is None
    services.rollout_engine(plan=services.plan)  # the configured plan: an FP8 block engine
    fp8 = started.calls[1]["kwargs"]
    assert fp8["quantization"] == "compressed-tensors"
    assert fp8["hf_overrides"]["quantization_config"]["config_groups"]


def test_a_bf16_configuration_starts_a_quantized_engine_for_a_quantized_plan(monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Path) -> None:
    from domain.quant.plan import QuantizationPlan

    services, started = _disaggregated(monkeypatch, tmp_path, "rollout.quantization.linear=null",
                                       "rollout.quantization.moe=null")
    assert not services.plan.is_quantized
    plan = QuantizationPlan.from_presets("FP8_BLOCK", "FP8_BLOCK")
    services.rollout_engine(plan=plan)
    (call,) = started.calls
    qc = call["kwargs"]["hf_overrides"]["quantization_config"]
    assert call["kwargs"]["quantization"] == "compressed-tensors"
    assert {g["weights"]["block_structure"][0] for g in qc["config_groups"].values()} == {128}


@pytest.mark.parametrize(("cpus", "workers", "binding"), [
    ((0, 1), 2, "0|1"), ((3, 2, 1, 0), 2, "0,1|2,3"), ((0, 1, 2), 2, "0|1,2"), ((5,), 1, "5"),
])
def test_thread_binding_splits_the_cores_one_group_per_worker(cpus: tuple[int, ...], workers: int,
                                                              binding: str) -> None:
    from adapters.vllm.factory import thread_binding

    assert thread_binding(cpus, workers) == binding


def test_thread_binding_refuses_fewer_cores_than_workers() -> None:
    from adapters.vllm.factory import thread_binding

    with pytest.raises(ConfigError, match=r"tensor_parallel_size.*2 workers need a core each"):
        thread_binding((0,), 2)


def test_a_tensor_parallel_engine_binds_each_worker_to_its_cores(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    import os

    services, started = _disaggregated(monkeypatch, tmp_path, "rollout.engine_kwargs.vllm.engine_args="
                                       "{enforce_eager: true, tensor_parallel_size: 2}")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip(f"this process may run on {len(cores)} core; a binding of two workers needs two")
    services.rollout_engine()
    services.engines.cold_start(tmp_path)  # the cold start of the same run: the same binding
    live, cold = started.calls
    half = len(cores) // 2
    expected = f"{','.join(map(str, cores[:half]))}|{','.join(map(str, cores[half:]))}"
    assert live["env"]["VLLM_CPU_OMP_THREADS_BIND"] == cold["env"]["VLLM_CPU_OMP_THREADS_BIND"] == expected
    assert live["kwargs"]["tensor_parallel_size"] == 2


def test_a_binding_the_user_gives_is_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    services, started = _disaggregated(
        monkeypatch, tmp_path, "rollout.engine_kwargs.vllm.engine_args={tensor_parallel_size: 2}",
        "rollout.engine_kwargs.vllm.environment={VLLM_CPU_OMP_THREADS_BIND: '7|9'}")
    services.rollout_engine()
    assert started.calls[0]["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "7|9"


def test_one_worker_keeps_vllms_own_binding(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    services, started = _disaggregated(monkeypatch, tmp_path)
    services.rollout_engine()
    assert "VLLM_CPU_OMP_THREADS_BIND" not in started.calls[0]["env"]


def test_a_tensor_parallel_engine_refuses_the_colocated_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    from adapters.engine_plugin import EnginePlugin

    monkeypatch.setattr(EnginePlugin, "require", lambda *_: None)  # refused before vLLM is imported
    services = bootstrap(overrides=[*BASE, "rollout.deployment=colocated",
                                    "rollout.engine_kwargs.vllm.engine_args={tensor_parallel_size: 2}"])
    with pytest.raises(ConfigError, match=r"rollout.deployment.*2 workers.*disaggregated"):
        services.rollout_engine()


def test_vllm_replicas_start_one_server_each_and_refuse_the_colocated_shape(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    from app.services.replicas import ReplicatedEngine

    services, started = _disaggregated(monkeypatch, tmp_path, "rollout.replicas=2")
    engine = services.rollout_engine()
    assert isinstance(engine, ReplicatedEngine) and len(engine.replicas) == 2 and len(started.calls) == 2
    with pytest.raises(ConfigError, match=r"rollout.replicas.*disaggregated"):
        bootstrap(overrides=[*BASE, "rollout.replicas=2"]).rollout_engine()
    with pytest.raises(ConfigError, match=r"rollout.replicas: must be 1 or more"):
        bootstrap(overrides=["rollout.replicas=0"])


@pytest.mark.parametrize(("transport", "ownership", "backend"), [("shm", "by_reference", "shm"),
                                                                  ("gloo", "reused", "gloo")])
def test_the_transport_decides_how_the_trainer_hands_over_its_buckets(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path, transport: str,
                                                                       ownership: str, backend: str) -> None:
    """Through the shared-memory ring the trainer writes each exported tensor straight into the
    ring (no packing first); over gloo it packs each bucket into one reused buffer."""
    services, _ = _disaggregated(monkeypatch, tmp_path, f"rollout.engine_kwargs.vllm.transport={transport}")
    service = services.refit_service()
    assert service.ownership.value == ownership
    assert service.engine.settings["transport"] == backend  # type: ignore[attr-defined]
