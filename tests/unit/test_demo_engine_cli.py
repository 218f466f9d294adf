"""`refit demo --engine vllm`'s command line: its defaults, its configuration of the engine, and the
options that do not go with a real engine (refused on one line, exit 2, before anything starts)."""

from __future__ import annotations

import pytest

from app.cli.demo_engine import engine_settings
from app.cli.demo_modes import resolve
from app.cli.main import build_parser, main
from app.services.demo_config import engine_config, with_engine_args


def _args(*argv: str):  # type: ignore[no-untyped-def]
    args = build_parser().parse_args(["demo", *argv])
    resolve(args, notice=lambda line: None)
    return args


def test_defaults_are_what_the_cpu_build_serves() -> None:
    s = engine_settings(_args("vllm"))
    assert (s.deployment, s.plan.linear.name, s.plan.moe.name, s.model, s.steps, s.back) == \
        ("disaggregated", "FP8_BLOCK", "FP8_BLOCK", "micro-moe", 2, True)
    s = engine_settings(_args("vllm", "--colocated", "--linear", "BF16", "--moe", "BF16", "--steps", "1"))
    assert (s.deployment, s.plan.is_quantized, s.steps) == ("colocated", False, 1)


def test_the_engine_configuration() -> None:
    s = engine_settings(_args("vllm", "--model", "micro-dense", "--seed", "4"))
    config = engine_config(s, 0.5)
    assert (config.rollout.name, config.rollout.deployment) == ("vllm", "disaggregated")
    assert (config.reference.model, config.reference.seed) == ("micro-dense", 4)
    assert config.rollout.quantization.linear == "FP8_BLOCK"
    assert config.rollout.checkpoint_engine.update_weights_bucket_megabytes == 0.5
    assert config.rollout.engine_kwargs.vllm.engine_args["skip_tokenizer_init"] is True
    more = with_engine_args(config, start_timeout_s=30, worker_extension_cls="x.Y")
    assert more.rollout.engine_kwargs.vllm.engine_args == {**config.rollout.engine_kwargs.vllm.engine_args,
                                                           "worker_extension_cls": "x.Y"}
    assert more.rollout.engine_kwargs.vllm.start_timeout_s == 30 and more.reference == config.reference


@pytest.mark.parametrize(("argv", "message"), [
    (["vllm", "--procs", "2"], "--procs: is not an option of `refit demo vllm`; it selects `refit demo procs`"),
    (["vllm", "--presets"], "--presets: is not an option of `refit demo vllm`; it is an option of `refit demo`"),
    (["vllm", "--commit-mode", "per-layer"], "--commit-mode: is not an option of `refit demo vllm`"),
    (["--colocated"], "--colocated: is not an option of `refit demo`; it is an option of `refit demo lora` and"),
    (["lora", "--colocated"], "--colocated: goes with --engine vllm"),
    (["vllm", "--trainer", "megatron"], "--trainer: is not an option of `refit demo vllm`; it selects "
                                        "`refit demo megatron`"),
    (["--qat", "--trainer", "megatron"], "--qat: is not an option of `refit demo megatron`"),  # the old spellings
    (["lora", "--engine", "vllm", "--sync", "merged"], "--sync: merged refits into vllm are ordinary refits"),
    (["vllm", "--inject-fault", "bucket:1", "--fault-step", "9"], "--fault-step must be in [0, 2]"),
])
def test_an_option_of_another_mode_is_refused_by_name(argv: list[str], message: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
