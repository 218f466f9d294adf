"""`refit demo ENGINE [--colocated]`: the demo's refit loop on a real engine, each refit
compared with a cold start of the same exported checkpoint (app.services.engine_demo). Its
defaults (the preset, the model) are the engine plugin's (adapters.engine_plugin.DemoDefaults)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from app.bootstrap import bootstrap, demo_of
from app.services.demo_config import engine_config, is_directory
from app.services.engine_demo import EngineDemoResult, EngineDemoSettings, EngineStep, run_engine_demo
from app.services.transaction import describe_plan
from domain.quant.plan import QuantizationPlan


def _preset(value: str | None, default: str | None) -> str | None:
    if value is None:
        return default
    return None if value.strip().upper() == "BF16" else value


def engine_settings(args: argparse.Namespace) -> EngineDemoSettings:
    """EngineDemoSettings from the command line (ConfigError / ValueError name a bad value)."""
    demo = demo_of(args.engine)
    plan = QuantizationPlan.from_presets(linear=_preset(args.linear, demo.preset), moe=_preset(args.moe, demo.preset),
                                         moe_activation=args.moe_activation,
                                         linear_activation=args.linear_activation)
    if args.attach and args.colocated:
        from domain.errors import ConfigError

        raise ConfigError("--attach", "refits a server you started; it does not go with --colocated")
    deployment = "attached" if args.attach else "colocated" if args.colocated else "disaggregated"
    return EngineDemoSettings(
        engine=args.engine, deployment=deployment, plan=plan, url=args.attach,
        model=args.model or demo.model, seed=args.seed, steps=2 if args.steps is None else args.steps,
        inject_fault=args.inject_fault, fault_step=args.fault_step,
    )


def _row(s: EngineStep) -> list[str]:
    rep = s.report
    yes_no = {True: "yes", False: "NO", None: "-"}
    return [s.label, rep.outcome.value, f"{rep.timings['total'] * 1e3:.0f}", str(rep.buckets),
            str(rep.parameters_written if rep.parameters_written is not None else "-"), str(len(rep.unwritten)),
            str(rep.storage), str(rep.probe or "-"), s.serving, yes_no[s.equals_cold_start],
            f"{s.max_abs_logp_diff:.3g}" if s.max_abs_logp_diff is not None else "-", str(rep.kv_scales_reset)]


def _render(result: EngineDemoResult, console: Console) -> None:
    s = result.settings
    console.print(f"[bold]refit demo[/bold] on a real {s.engine} engine ({s.deployment}): plan "
                  f"{describe_plan(s.plan)}, model {s.model}, seed {s.seed}; {s.steps} steps, then back to step 0")
    console.print(f"- before its first refit the engine refused to serve: "
                  f"{'yes' if result.refused_before_first_refit else 'NO'}")
    table = Table(title="one row per refit; each live refit against a cold start of the same export")
    for col in ("step", "outcome", "ms", "buckets", "written", "unwritten", "storage", "probe", "serving",
                "= cold start", "max |dlogp|", "KV resets"):
        table.add_column(col)
    for step in result.steps:
        table.add_row(*_row(step))
    console.print(table)
    for step in result.steps:
        if not step.report.ok:
            console.print(f"- step {step.label}: {step.report.error}")
        elif step.equals_cold_start is False:
            console.print(f"- step {step.label}: differs from the cold start: log-probs equal {step.logprobs_equal}, "
                          f"tokens equal {step.tokens_equal}, weights differing {list(step.differing_weights)}")
    unreadable = sorted({n for step in result.steps for n in step.unreadable})
    if unreadable:
        console.print(f"- {len(unreadable)} weights were not compared byte for byte: the engine keeps them packed "
                      f"outside their (empty) parameter ({', '.join(unreadable[:3])}{', ...' if len(unreadable) > 3 else ''}); "
                      "the log-probs and greedy tokens check them")
    console.print("- every live refit equals its cold start bit for bit" if result.ok
                  else "- NOT every live refit equals its cold start (or a failed refit kept serving)")


def _payload(result: EngineDemoResult) -> dict[str, Any]:
    s = result.settings
    return {
        "engine": s.engine, "deployment": s.deployment, "plan": describe_plan(s.plan), "model": s.model,
        "seed": s.seed, "refused_before_first_refit": result.refused_before_first_refit,
        "steps": [step.to_dict() for step in result.steps], "fault_fired": result.fault_fired, "ok": result.ok,
    }


def run_engine(args: argparse.Namespace) -> int:
    """Run the real-engine demo; exit 0 when every live refit equals its cold start."""
    settings = engine_settings(args)
    services = bootstrap(engine_config(settings, args.bucket_mb))
    if is_directory(settings.model):  # before the engine starts from its config.json
        services.check_checkpoint_config(settings.model)
    console = None if args.json else Console(width=max(Console().width, 140), stderr=False)
    if console is not None:
        console.print(f"attaching to the {settings.engine} server at {settings.url} ..." if settings.url else
                      f"starting the {settings.engine} engine ({settings.deployment}) ...")
    result = run_engine_demo(settings, services)
    if args.json:
        sys.stdout.write(json.dumps(_payload(result), indent=2, default=str) + "\n")
    else:
        assert console is not None
        _render(result, console)
    return 0 if result.ok else 1
