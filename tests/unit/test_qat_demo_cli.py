"""`refit demo qat PRESET --engine vllm` without vLLM: the configuration it builds (one engine in
this process, the 4-bit presets on the experts), the options it refuses, its routing to the QAT
demo with one engine (the embedded engine standing in for vLLM's), and what it reports when the
engine cannot start a cell the support matrix says this CPU does not serve."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

import app.cli.demo_qat as demo_qat
from app.bootstrap import Services, bootstrap
from app.cli.demo_qat import engine_qat_config, qat_demo_services
from app.cli.main import main
from app.services.qat_demo import run_qat_demo
from domain.errors import EngineClosed
from domain.quant.plan import QuantizationPlan

NO_MARLIN = "'_OpNamespace' '_C' object has no attribute 'gptq_marlin_repack'"  # what vLLM's CPU build raises


@pytest.mark.parametrize(("preset", "linear", "moe", "activation"), [
    ("FP8_BLOCK", "FP8_BLOCK", "FP8_BLOCK", None), ("mxfp8", "MXFP8", "MXFP8", None),
    ("MXFP4", None, "MXFP4", None), ("NVFP4", None, "NVFP4", None),
])
def test_the_configuration_serves_the_preset_where_vllm_serves_it(preset: str, linear: str | None, moe: str,
                                                                  activation: str | None) -> None:
    config = engine_qat_config("vllm", preset, "micro-moe", 3, 0.5)
    assert (config.rollout.name, config.rollout.deployment) == ("vllm", "colocated")
    q = config.rollout.quantization
    assert (q.linear, q.moe, q.moe_activation) == (linear, moe, activation)
    assert (config.actor.megatron.qat.enable, config.actor.megatron.qat.mode) == (True, preset)
    assert (config.reference.model, config.reference.seed) == ("micro-moe", 3)
    assert config.rollout.checkpoint_engine.update_weights_bucket_megabytes == 0.5


@pytest.mark.parametrize(("argv", "message"), [
    (["--attach", "http://127.0.0.1:8000"], "--attach: is not an option of `refit demo qat`; it is an option of `refit demo vllm`"),
    (["--linear", "MXFP8"], "--linear: is not an option of `refit demo qat`"),
    (["--moe-activation", "mxfp8"], "--moe-activation: is not an option of `refit demo qat`"),
    (["--inject-fault", "bucket:1"], "--inject-fault: is not an option of `refit demo qat`"),
    (["--procs", "2"], "--procs: is not an option of `refit demo qat`"),
    (["--plot", "out.png"], "--plot: is not an option of `refit demo qat`"),
])
def test_options_the_vllm_qat_demo_refuses(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "qat", "MXFP8", "--engine", "vllm", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_qat_mode_without_vllm_roles_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "qat", "w4a16", "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert "--qat: 'w4a16' with --engine vllm: use one of FP8_BLOCK, MXFP8, MXFP4, NVFP4" in err


def test_the_command_runs_both_arms_through_one_engine(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # the embedded engine, serving the same plan, stands in for the colocated vLLM engine
    stand_in = qat_demo_services("MXFP8", "micro-moe", 0).rollout_engine(QuantizationPlan.from_presets("MXFP8", "MXFP8"))
    built: list[Services] = []

    def with_stand_in(config: Any, **kwargs: Any) -> Services:
        services = bootstrap(config, engine=stand_in, **kwargs)
        built.append(services)
        return services

    monkeypatch.setattr(demo_qat, "bootstrap", with_stand_in)
    assert main(["demo", "qat", "MXFP8", "--engine", "vllm", "--steps", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s.config.rollout.name for s in built] == ["vllm"]
    assert (out["engine"], out["model"], out["served"], out["plan"]) == ("vllm", "micro-moe", True,
                                                                         "linear=MXFP8 moe=MXFP8")
    assert [(r["step"], r["arm"]) for r in out["records"]] == [(0, "bf16"), (0, "qat"), (1, "bf16"), (1, "qat")]
    for r in out["records"]:
        assert math.isfinite(r["k3_quantized"]) and math.isfinite(r["rollout_corr/k3_kl"]) and r["k3_bf16"] is None
    # the embedded engine computes what the QAT forward computes: with QAT the mismatch is 0
    assert all(r["k3_quantized"] == 0.0 for r in out["records"] if r["arm"] == "qat")
    assert all(r["k3_quantized"] > 0.0 for r in out["records"] if r["arm"] == "bf16")
    mean = out["mean"]
    assert mean["k3_bf16_level"] is None and mean["k3_quantized_with_qat"] < mean["k3_quantized_without_qat"]
    with pytest.raises(EngineClosed):  # the demo closed the one engine it started
        stand_in.log_probs(torch.zeros(1, 8, dtype=torch.int64))


class _NoStart:
    """The composition root's services, whose engine fails to start as vLLM's CPU build does for
    MXFP4 experts (Marlin's weight repack is missing)."""

    def __init__(self, services: Services) -> None:
        self._services = services

    def __getattr__(self, name: str) -> Any:
        return getattr(self._services, name)

    def rollout_engine(self, plan: QuantizationPlan | None = None) -> Any:
        raise AttributeError(NO_MARLIN)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU serves every cell: a failed start is not the CPU's limit")
def test_a_cell_this_cpu_does_not_serve_is_reported_with_the_engines_reason() -> None:
    services = _NoStart(bootstrap(engine_qat_config("vllm", "MXFP4", "micro-moe", 0, 1.0)))
    result = run_qat_demo(services, mode="MXFP4", model="micro-moe", steps=1, one_engine=True)
    assert (result["served"], result["records"], result["mean"]) == (False, [], None)
    assert result["not_served"] == ("vllm's CPU build does not serve rollout.quantization.moe=MXFP4 with mxfp4 "
                                    f"activations (docs/support-matrix.md); starting the engine failed with "
                                    f"AttributeError: {NO_MARLIN}")


def test_a_missing_vllm_is_named_not_reported_as_a_cell_not_served(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here: the engine would start")
    assert main(["demo", "qat", "MXFP4", "--engine", "vllm", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "ModuleNotFoundError" in err and "needs vllm" in err and "does not serve" not in err


def test_a_cell_this_cpu_serves_that_fails_to_start_is_an_error() -> None:
    services = _NoStart(bootstrap(engine_qat_config("vllm", "MXFP8", "micro-moe", 0, 1.0)))
    with pytest.raises(AttributeError, match="gptq_marlin_repack"):
        run_qat_demo(services, mode="MXFP8", model="micro-moe", steps=1, one_engine=True)
