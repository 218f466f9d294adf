"""`refit demo --qat [PRESET]`: training with QAT and without, and the rollout mismatch of each.

The comparison itself is app.services.qat_demo; this module configures the composition root for
it (rollout and QAT both in PRESET, the embedded model of `--model` and `--seed`) and prints the
result as a table or JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from app.bootstrap import Services, bootstrap
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


def qat_demo_services(mode: str, model: str, seed: int) -> Services:
    """The composition root's services for the QAT demo in `mode` on the embedded `model`."""
    return bootstrap(RefitConfig(
        rollout=RolloutConfig(quantization=QuantizationConfig(linear=mode, moe=mode)),
        actor=ActorConfig(megatron=MegatronConfig(qat=QatConfig(enable=True, mode=mode))),
        reference=ReferenceConfig(model=model, seed=seed),
    ))


def render_qat_demo(result: dict[str, Any], console: Console) -> None:
    """Print the demo's table and its conclusion with rich.

    Args:
        result: what run_qat_demo returned.
        console: a rich Console.
    """
    console.print(f"[bold]refit demo --qat[/bold]: rollout linear={result['mode']} moe={result['mode']}, "
                  f"qat.mode={result['mode']}, model {result['model']}, {result['qat_layers']} layers fake-quantized")
    table = Table()
    for col in ("step", "training", "train loss", f"k3 vs {result['mode']} rollout", "k3 vs BF16 rollout",
                "rollout NLL"):
        table.add_column(col)
    for r in result["records"]:
        table.add_row(
            str(r["step"]), "QAT" if r["arm"] == "qat" else "BF16",
            "-" if r["train_loss"] is None else f"{r['train_loss']:.4f}", f"{r['k3_quantized']:.3e}",
            "-" if r["k3_bf16"] is None else f"{r['k3_bf16']:.3e}", f"{r['rollout_nll']:.4f}",
        )
    console.print(table)
    f = result["final"]
    console.print(
        f"after {result['steps']} steps, k3 KL of the {result['mode']} rollout: {f['k3_quantized_without_qat']:.3e} "
        f"trained without QAT, {f['k3_quantized_with_qat']:.3e} with QAT; BF16 level {f['k3_bf16_level']:.3e}"
    )


def run_cli(args: argparse.Namespace) -> int:
    """Run the QAT comparison and print it (a table, or JSON); returns the exit status."""
    console = Console(stderr=bool(args.json))
    model = args.model or "tiny-moe"
    steps = 3 if args.steps is None else args.steps
    services = qat_demo_services(args.qat, model, args.seed)
    with console.status(f"training with and without QAT ({args.qat}), {steps} steps"):
        result = run_qat_demo(services, mode=args.qat, model=model, steps=steps, seed=args.seed)
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
    else:
        render_qat_demo(result, console)
    return 0
