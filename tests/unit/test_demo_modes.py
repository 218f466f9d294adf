"""`refit demo MODE`: each mode takes only its own options, each option is declared once
(app.cli.demo_modes.OPTIONS), and the spellings of the previous release still select their mode,
with a notice."""

from __future__ import annotations

import argparse

import pytest

from app.cli.demo_modes import EMBEDDED, MODES, OPTIONS, resolve
from app.cli.main import build_parser, main


def _resolved(*argv: str) -> tuple[argparse.Namespace, list[str]]:
    notices: list[str] = []
    args = build_parser().parse_args(["demo", *argv])
    resolve(args, notice=notices.append)
    return args, notices


@pytest.mark.parametrize("mode", [EMBEDDED, *MODES])
def test_a_modes_help_lists_its_options_and_no_other(mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--help"] if mode == EMBEDDED else ["demo", mode, "--help"]) == 0
    shown = capsys.readouterr().out
    usage = shown.split("\n\n")[0]  # `usage: refit demo ... [--flag VALUE] ...`: what the parser takes
    for option in OPTIONS:
        flag = option.flags[0] if option.flags[0].startswith("-") else option.kwargs["metavar"]
        assert (f"[{flag}" in usage) == (mode in option.modes), f"{flag} in `refit demo {mode} --help`: {usage}"
    if mode == EMBEDDED:  # and the modes, each with its line
        assert all(m in shown and line.split()[0] in shown for m, line in MODES.items())


@pytest.mark.parametrize(("argv", "mode", "values"), [
    ([], EMBEDDED, {"engine": "reference", "trainer": "reference", "procs": None, "qat": None, "lora": None}),
    (["vllm", "--colocated"], "vllm", {"engine": "vllm", "colocated": True, "steps": None}),
    (["--steps", "2", "vllm"], "vllm", {"steps": 2}),  # the demo's options before the mode count
    (["procs"], "procs", {"procs": 3, "fault_rank": None}),
    (["procs", "4", "--fault-rank", "2"], "procs", {"procs": 4, "fault_rank": 2}),
    (["procs", "--engine", "vllm"], "procs", {"procs": 3, "engine": "vllm"}),
    (["qat"], "qat", {"qat": "NVFP4", "engine": "reference"}),
    (["qat", "MXFP8", "--engine", "vllm"], "qat", {"qat": "MXFP8", "engine": "vllm"}),
    (["lora", "--sync", "adapter"], "lora", {"lora": 16, "lora_sync": "adapter", "engine": "reference"}),
    (["lora", "8", "--engine", "vllm", "--colocated"], "lora", {"lora": 8, "engine": "vllm", "colocated": True}),
    (["megatron", "--tp", "2"], "megatron", {"trainer": "megatron", "tp": 2, "pp": 1}),
    (["megatron", "--engine", "vllm"], "megatron", {"trainer": "megatron", "engine": "vllm"}),
])
def test_each_mode_gets_its_options_and_their_defaults(argv: list[str], mode: str, values: dict) -> None:
    args, notices = _resolved(*argv)
    assert args.mode == mode and notices == []
    assert {k: getattr(args, k) for k in values} == values
    assert all(hasattr(args, o.dest) for o in OPTIONS)  # every option set: the modes' code reads them


@pytest.mark.parametrize(("argv", "mode", "values"), [
    (["--engine", "vllm", "--colocated"], "vllm", {"engine": "vllm", "colocated": True}),
    (["--procs", "2"], "procs", {"procs": 2}),
    (["--procs", "2", "--engine", "vllm"], "procs", {"procs": 2, "engine": "vllm"}),
    (["--qat"], "qat", {"qat": "NVFP4", "engine": "reference"}),
    (["--qat", "MXFP8", "--engine", "vllm"], "qat", {"qat": "MXFP8", "engine": "vllm"}),
    (["--lora", "8", "--lora-sync", "adapter"], "lora", {"lora": 8, "lora_sync": "adapter"}),
    (["--lora", "8", "--engine", "vllm"], "lora", {"lora": 8, "engine": "vllm"}),
    (["--trainer", "megatron", "--tp", "2"], "megatron", {"trainer": "megatron", "tp": 2}),
])
def test_the_previous_spellings_select_their_mode_with_a_notice(argv: list[str], mode: str, values: dict) -> None:
    args, notices = _resolved(*argv)
    assert args.mode == mode and {k: getattr(args, k) for k in values} == values
    assert len(notices) == 1 and f"use `refit demo {mode} ...`" in notices[0], notices


def test_the_previous_defaults_spelled_out_select_nothing() -> None:
    args, notices = _resolved("--engine", "reference", "--trainer", "reference")
    assert args.mode == EMBEDDED and notices == []


def test_the_notice_goes_to_stderr_and_the_refusal_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--procs", "2", "--colocated"]) == 2  # refused before any notice
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--colocated: is not an option of `refit demo procs`" in err[0], err


def _help_of(mode: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["demo", "--help"] if mode == EMBEDDED else ["demo", mode, "--help"]) == 0
    return " ".join(capsys.readouterr().out.split())  # argparse's line wrapping undone


@pytest.mark.parametrize("mode", [EMBEDDED, "vllm", "procs", "megatron"])
def test_a_modes_help_states_the_defaults_its_settings_take(mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli.demo_engine import engine_settings
    from app.cli.demo_settings import settings_from_args

    args, _ = _resolved(*([] if mode == EMBEDDED else [mode]))
    s = engine_settings(args) if mode == "vllm" else settings_from_args(args)
    shown = _help_of(mode, capsys)
    plan = s.plan
    end = "; " if mode in ("procs", "megatron") else ")"  # these state the real engine's defaults after their own
    assert f"preset for dense Linear layers, or BF16 (default {plan.linear.name})" in shown
    assert f"preset for routed experts, or BF16 (default {plan.moe.name}{end}" in shown
    assert f"after the initial sync (default {s.steps}{end}" in shown and f"default {s.model}{end}" in shown
    assert "on vLLM" not in shown  # no other mode's default


@pytest.mark.parametrize("mode", ["procs", "megatron"])
def test_a_worlds_help_states_the_real_engines_defaults_its_settings_take(mode: str,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from app.cli.demo_settings import real_engine_settings, settings_from_args

    args, _ = _resolved(mode, "--engine", "vllm")
    s = real_engine_settings(args, settings_from_args(args))
    assert s is not None and s.engine == "vllm" and s.deployment == "disaggregated"
    shown = _help_of(mode, capsys)
    assert f"{s.plan.moe.name} with --engine vllm)" in shown and s.plan.linear.name == "FP8_BLOCK"
    assert f"(default 3; {s.steps} with --engine vllm)" in shown and f"{s.model} with --engine vllm)" in shown
    args, _ = _resolved(mode, "--engine", "vllm", "--linear", "MXFP8")  # the other component keeps vLLM's default
    s = real_engine_settings(args, settings_from_args(args))
    assert s is not None and (s.plan.linear.name, s.plan.moe.name) == ("MXFP8", "FP8_BLOCK")


def test_the_lora_and_qat_help_state_both_engines_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from app.bootstrap import demo_of

    vllm = demo_of("vllm")
    lora = _help_of("lora", capsys)
    assert f"default tiny-moe; {vllm.lora_model} with --engine vllm" in lora
    assert "(default 3; 2 with --engine vllm)" in lora and "BF16 with --engine vllm" in lora
    assert f"default tiny-moe; {vllm.model} with --engine vllm" in _help_of("qat", capsys)
