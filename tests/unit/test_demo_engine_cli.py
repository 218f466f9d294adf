"""`refit demo --engine vllm`'s command line: its defaults, its configuration of the engine, and the
options that do not go with a real engine (refused on one line, exit 2, before anything starts)."""

from __future__ import annotations

import pytest

from app.cli.demo_engine import engine_overrides, engine_settings
from app.cli.main import build_parser, main


def _args(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["demo", *argv])


def test_defaults_are_what_the_cpu_build_serves() -> None:
    s = engine_settings(_args("--engine", "vllm"))
    assert (s.deployment, s.plan.linear.name, s.plan.moe.name, s.model, s.steps, s.back) == \
        ("disaggregated", "FP8_BLOCK", "FP8_BLOCK", "micro-moe", 2, True)
    s = engine_settings(_args("--engine", "vllm", "--colocated", "--linear", "BF16", "--moe", "BF16", "--steps", "1"))
    assert (s.deployment, s.plan.is_quantized, s.steps) == ("colocated", False, 1)


def test_the_engine_configuration() -> None:
    s = engine_settings(_args("--engine", "vllm", "--model", "micro-dense", "--seed", "4"))
    overrides = engine_overrides(s, 0.5)
    assert "rollout.name=vllm" in overrides and "rollout.deployment=disaggregated" in overrides
    assert "reference.model=micro-dense" in overrides and "reference.seed=4" in overrides
    assert "rollout.quantization.linear=FP8_BLOCK" in overrides
    assert any(o.startswith("rollout.engine_kwargs.vllm.engine_args=") and "skip_tokenizer_init: true" in o
               for o in overrides)


@pytest.mark.parametrize(("argv", "message"), [
    (["--engine", "vllm", "--procs", "2"], "--procs: does not go with --engine vllm"),
    (["--engine", "vllm", "--presets"], "--presets: does not go with --engine vllm"),
    (["--engine", "vllm", "--commit-mode", "per-layer"], "--commit-mode: does not go with --engine vllm"),
    (["--colocated"], "--colocated: goes with --engine vllm"),
    (["--engine", "vllm", "--trainer", "megatron"], "--trainer: does not go with --engine vllm"),
    (["--qat", "--trainer", "megatron"], "--qat: does not go with --trainer megatron"),
    (["--engine", "vllm", "--inject-fault", "bucket:1", "--fault-step", "9"], "--fault-step must be in [0, 2]"),
])
def test_options_that_do_not_go_with_a_real_engine(argv: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
