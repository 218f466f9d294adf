"""`refit demo --engine vllm`'s command line: its defaults, its configuration of the engine, and the
options that do not go with a real engine (refused on one line, exit 2, before anything starts)."""

from __future__ import annotations

import pytest

from app.cli.demo_engine import engine_settings
from app.cli.main import build_parser, main
from app.services.demo_config import engine_config, with_vllm


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
    config = engine_config(s, 0.5)
    assert (config.rollout.name, config.rollout.deployment) == ("vllm", "disaggregated")
    assert (config.reference.model, config.reference.seed) == ("micro-dense", 4)
    assert config.rollout.quantization.linear == "FP8_BLOCK"
    assert config.rollout.checkpoint_engine.update_weights_bucket_megabytes == 0.5
    assert config.rollout.engine_kwargs.vllm.engine_args["skip_tokenizer_init"] is True
    more = with_vllm(config, start_timeout_s=30, worker_extension_cls="x.Y")
    assert more.rollout.engine_kwargs.vllm.engine_args == {**config.rollout.engine_kwargs.vllm.engine_args,
                                                           "worker_extension_cls": "x.Y"}
    assert more.rollout.engine_kwargs.vllm.start_timeout_s == 30 and more.reference == config.reference


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
