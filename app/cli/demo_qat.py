"""`refit demo qat [PRESET] [--engine ENGINE]`: training with QAT and without, and the rollout mismatch of each.

The comparison itself is app.services.qat_demo; this module configures the composition root for
it and prints the result as a table or JSON:
- the embedded engine: rollout and QAT both in PRESET on every Linear and expert;
- a real engine (`--engine`, one whose plugin runs the demos): one engine in this process
  (colocated, started with dummy weights from the embedded model's config.json, as `refit demo
  ENGINE --colocated` starts it), serving PRESET on the roles its plugin names
  (adapters.engine_plugin.DemoDefaults.qat_roles; docs/qat.md, "On the real engine").
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table

from app.bootstrap import DEMO_ENGINES, Services, bootstrap, demo_of
from app.config_sections import (
    ActorConfig,
    MegatronConfig,
    QatConfig,
    QuantizationConfig,
    ReferenceConfig,
    RefitConfig,
    RolloutConfig,
)
from app.services.qat_demo import run_qat_demo
from domain.errors import ConfigError
from domain.quant.plan import QuantizationPlan


def qat_demo_services(mode: str, model: str, seed: int) -> Services:
    """The composition root's services for the QAT demo in `mode` on the embedded `model`."""
    return bootstrap(RefitConfig(
        rollout=RolloutConfig(quantization=QuantizationConfig(linear=mode, moe=mode)),
        actor=ActorConfig(megatron=MegatronConfig(qat=QatConfig(enable=True, mode=mode))),
        reference=ReferenceConfig(model=model, seed=seed),
    ))


def engine_qat_config(engine: str, mode: str, model: str, seed: int, bucket_mb: float) -> RefitConfig:
    """The configuration of the QAT demo on a real engine: a colocated engine serving `mode` on the
    roles its plugin names (DemoDefaults.qat_roles), QAT in `mode`, the embedded `model`
    (ConfigError naming --qat for a preset it has no roles for)."""
    from app.services.demo_config import engine_config
    from app.services.engine_demo import EngineDemoSettings

    roles = demo_of(engine).qat_roles.get(mode.strip().upper())
    if roles is None:
        raise ConfigError("--qat", f"{mode!r} with --engine {engine}: use one of "
                          f"{', '.join(demo_of(engine).qat_roles)}")
    plan = QuantizationPlan.from_presets(linear=roles[0], moe=roles[1])
    settings = EngineDemoSettings(engine=engine, deployment="colocated", plan=plan, model=model, seed=seed)
    config = engine_config(settings, bucket_mb)
    megatron = attrs.evolve(config.actor.megatron, qat=QatConfig(enable=True, mode=mode))
    return attrs.evolve(config, actor=attrs.evolve(config.actor, megatron=megatron))


def render_qat_demo(result: dict[str, Any], console: Console) -> None:
    """Print the demo's table and its conclusion with rich.

    Args:
        result: what run_qat_demo returned (and `engine`, the engine's name).
        console: a rich Console.
    """
    engine = result.get("engine", "reference")
    console.print(f"[bold]refit demo qat[/bold] on the {engine} engine: rollout {result['plan']}, "
                  f"qat.mode={result['mode']}, model {result['model']}, {result['qat_layers']} layers fake-quantized")
    if not result["served"]:
        console.print(f"- not run: {result['not_served']}")
        return
    bf16_level = result["mean"]["k3_bf16_level"] is not None
    table = Table()
    for col in ("step", "training", "train loss", f"k3 vs {result['mode']} rollout",
                *(("k3 vs BF16 rollout",) if bf16_level else ()), "rollout NLL"):
        table.add_column(col)
    for r in result["records"]:
        table.add_row(
            str(r["step"]), "QAT" if r["arm"] == "qat" else "BF16",
            "-" if r["train_loss"] is None else f"{r['train_loss']:.4f}", f"{r['k3_quantized']:.3e}",
            *(("-" if r["k3_bf16"] is None else f"{r['k3_bf16']:.3e}",) if bf16_level else ()),
            f"{r['rollout_nll']:.4f}",
        )
    console.print(table)
    f, m = result["final"], result["mean"]
    level = f"; BF16 level {f['k3_bf16_level']:.3e}" if bf16_level else ""
    console.print(
        f"after {result['steps']} steps, k3 KL of the {result['mode']} rollout: {f['k3_quantized_without_qat']:.3e} "
        f"trained without QAT, {f['k3_quantized_with_qat']:.3e} with QAT{level}"
    )
    console.print(f"mean over steps 0-{result['steps']}: {m['k3_quantized_without_qat']:.3e} without QAT, "
                  f"{m['k3_quantized_with_qat']:.3e} with QAT")


def run_cli(args: argparse.Namespace) -> int:
    """Run the QAT comparison and print it (a table, or JSON); returns the exit status (1 when the
    engine could not serve the preset here: nothing was measured)."""
    console = Console(stderr=bool(args.json))
    steps = 3 if args.steps is None else args.steps
    real = args.engine in DEMO_ENGINES
    if real:
        model = args.model or demo_of(args.engine).model
        services = bootstrap(engine_qat_config(args.engine, args.qat, model, args.seed, args.bucket_mb))
    else:
        model = args.model or "tiny-moe"
        services = qat_demo_services(args.qat, model, args.seed)
    with console.status(f"training with and without QAT ({args.qat}), {steps} steps"):
        result = run_qat_demo(services, mode=args.qat, model=model, steps=steps, seed=args.seed,
                              one_engine=real and demo_of(args.engine).one_per_process)
    result = {"engine": args.engine, **result}
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        render_qat_demo(result, console)
    return 0 if result["served"] else 1
