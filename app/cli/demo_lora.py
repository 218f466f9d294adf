"""`refit demo lora RANK --sync adapter`: the adapter mode's table and its JSON; with `--engine
ENGINE` (a real engine whose plugin has a LoRA demo), the adapter mode into that engine, each
adapter against the engine's own load of it (app.services.lora_engine_demo).

(`--sync merged`, the default on the embedded engine, is the ordinary demo on a trainer whose
weights are the merged model: app/cli/demo.py.)"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table

from app.cli.demo_settings import lora_arm_factory
from app.services.demo import DemoSettings
from app.services.lora_demo import LoraDemoResult, LoraStepRecord, run_lora_demo
from app.services.transaction import describe_plan

KiB = 1024


def _row(r: LoraStepRecord) -> list[str]:
    rep, m = r.report, (r.probe.metrics if r.probe else None)
    base = rep.base.bytes_sent if rep.base is not None else 0
    return [
        str(r.step), r.arm, "live" if rep.live else "kept", "yes" if rep.base is not None else "-",
        f"{base / KiB:.0f}", f"{rep.bytes_sent / KiB:.1f}", str(rep.adapter_id if rep.adapter_id is not None else "-"),
        f"{rep.seconds * 1e3:.1f}", r.serving, f"{m.k3_kl:.3e}" if m else "-",
        f"{m.mean_abs_logp_diff:.3e}" if m else "-",
    ]


def _notes(result: LoraDemoResult) -> list[str]:
    later = [r.report for r in result.records if r.step > 0 and r.report.live]
    notes = []
    if later:
        sent = max(r.bytes_sent for r in later)
        notes.append(f"each step after the first sent the adapter alone: {sent / KiB:.1f} KiB, "
                     f"{sent / result.adapter_bytes:.2f}x its own {result.adapter_bytes / KiB:.1f} KiB "
                     f"(budget 2x), against {result.model_bytes / KiB:.0f} KiB of BF16 base weights")
    for r in result.records:
        if not r.report.live:
            notes.append(f"step {r.step}, {r.arm}: {r.report.error}")
    if result.settings.inject_fault and all(r.report.live for r in result.records):
        notes.append(f"the injected fault {result.settings.inject_fault} never fired (fewer buckets than K?)")
    bf16 = [r for r in result.of("BF16") if r.probe]
    if bf16:
        exact = all(r.probe.metrics.k3_kl == 0 for r in bf16)  # type: ignore[union-attr]
        notes.append("BF16 arm: k3 KL = 0 exactly (the engine serves the trainer's merged model)" if exact
                     else "BF16 arm: NOT exact (a bug: the embedded engine merges the adapter as the trainer does)")
    return notes


def run_lora(args: argparse.Namespace, settings: DemoSettings) -> int:
    result = run_lora_demo(settings, lora_arm_factory(settings))
    if args.json:
        payload: dict[str, Any] = {
            "model": settings.model, "arms": list(result.arms), "adapter_bytes": result.adapter_bytes,
            "model_bytes": result.model_bytes,
            "settings": {**attrs.asdict(settings, recurse=False), "plan": describe_plan(settings.plan)},
            "steps": [r.to_dict() for r in result.records], "notes": _notes(result),
        }
        sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
        return 0
    console = Console(width=max(Console().width, 120))
    console.print(f"[bold]refit demo lora {settings.lora_rank} --sync adapter[/bold]: plan "
                  f"{describe_plan(settings.plan)} vs BF16 on {settings.model}; {settings.steps} steps on the adapter")
    table = Table(title="one row per arm and step (step 0 = base and adapter; later steps: the adapter alone)")
    for col in ("step", "arm", "outcome", "base sent", "base KiB", "adapter KiB", "adapter id", "ms", "serving",
                "k3 KL", "|dlogp|"):
        table.add_column(col, justify="left" if col in ("arm", "outcome", "serving") else "right")
    for r in result.records:
        table.add_row(*_row(r))
    console.print(table)
    for note in _notes(result):
        console.print(f"- {note}")
    return 0


def run_lora_engine(args: argparse.Namespace) -> int:
    """`refit demo lora --engine ENGINE`: exit 0 when every adapter step went live and equals its
    disk twin, bit for bit."""
    from app.bootstrap import bootstrap, demo_of
    from app.config_sections import LoraConfig
    from app.services.demo_config import engine_config
    from app.services.engine_demo import EngineDemoSettings
    from app.services.lora_engine_demo import run_lora_engine_demo
    from domain.errors import ConfigError
    from domain.quant.plan import QuantizationPlan

    engine = args.engine
    if args.lora_sync == "merged":
        raise ConfigError("--sync", f"merged refits into {engine} are ordinary refits of the merged model; on {engine} "
                          "the LoRA demo shows the adapter mode (drop --sync, or use --engine reference)")
    model = demo_of(engine).lora_model
    if model is None:
        raise ConfigError("--engine", f"{engine} has no LoRA demo; use --engine reference")
    plan = QuantizationPlan.from_presets(linear=_bf16_none(args.linear), moe=_bf16_none(args.moe),
                                         moe_activation=args.moe_activation, linear_activation=args.linear_activation)
    settings = EngineDemoSettings(engine=engine, deployment="colocated" if args.colocated else "disaggregated",
                                  plan=plan, model=args.model or model, seed=args.seed)
    config = engine_config(settings, args.bucket_mb)
    config = attrs.evolve(config, actor=attrs.evolve(config.actor, lora=LoraConfig(rank=args.lora, sync="adapter")))
    steps = 2 if args.steps is None else args.steps
    console = None if args.json else Console(width=max(Console().width, 120))
    if console is not None:
        console.print(f"starting the {engine} engine ({settings.deployment}) with LoRA adapters of rank {args.lora} ...")
    svc = bootstrap(config).lora.sync_service()
    try:
        records = run_lora_engine_demo(svc, steps, seed=args.seed)
    finally:
        svc.engine.close()  # type: ignore[attr-defined]
    ok = all(r.equal for r in records)
    if args.json:
        payload = {"engine": engine, "deployment": settings.deployment, "model": settings.model,
                   "plan": describe_plan(plan), "rank": args.lora, "seed": args.seed,
                   "steps": [r.to_dict() for r in records], "ok": ok}
        sys.stdout.write(json.dumps(payload, indent=2) + "\n")
        return 0 if ok else 1
    assert console is not None
    console.print(f"[bold]refit demo lora {args.lora} --engine {engine}[/bold] ({settings.deployment}): base plan "
                  f"{describe_plan(plan)}, model {settings.model}; {steps} steps on the adapter")
    table = Table(title=f"one row per step (step 0 = base and adapter); each adapter against {engine}'s own load of it")
    for col in ("step", "outcome", "base sent", "KiB sent", "adapter KiB", "= disk twin", "max |dlogp|"):
        table.add_column(col, justify="left" if col == "outcome" else "right")
    for r in records:
        table.add_row(str(r.step), "live" if r.live else "kept", "yes" if r.base_sent else "-",
                      f"{r.bytes_sent / KiB:.1f}", f"{r.adapter_bytes / KiB:.1f}", "yes" if r.equal else "NO",
                      f"{r.max_abs_diff:.3g}")
    console.print(table)
    for r in records:
        if not r.live:
            console.print(f"- step {r.step}: {r.error}")
    console.print(f"- every adapter equals {engine}'s own load of it, bit for bit" if ok
                  else f"- NOT every adapter equals {engine}'s own load of it")
    return 0 if ok else 1


def _bf16_none(value: str | None) -> str | None:
    """The base's preset: BF16 by default on a real engine (its LoRA kernels), None for BF16."""
    return None if value is None or value.strip().upper() == "BF16" else value
