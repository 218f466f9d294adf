"""`refit demo`: the main job. A refit round trip on the embedded default model, step after step.

Builds the reference model (a tiny Qwen3-like MoE, random weights from a seed), runs training-like
steps (perturb the weights, refit, probe the mismatch) for the chosen plan and for BF16, and
prints a table per step and a comparison. `--inject-fault bucket:K` shows the commit mode's
guarantee live; `--plot out.png` draws the mismatch per step for every preset; `--json` prints
everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

import attrs
import torch
from rich.console import Console
from rich.table import Table

from app.cli.demo_settings import arm_factory, settings_from_args
from app.services.demo import DemoResult, StepRecord, run_demo
from app.services.demo_config import is_directory
from app.services.transaction import describe_plan


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`refit demo`'s arguments: the embedded mode's, and one sub-parser per mode (app.cli.demo_modes)."""
    from app.cli.demo_modes import add_arguments as add_modes

    add_modes(p)


def _row(r: StepRecord) -> list[str]:
    rep = r.report
    m = r.probe.metrics if r.probe else None
    outcome = rep.outcome.value
    return [
        str(r.step), r.arm, outcome, f"{rep.timings['total'] * 1e3:.0f}", f"{rep.bytes_sent / 2**20:.2f}",
        str(rep.buckets), str(rep.storage), r.serving,
        f"{m.k3_kl:.3e}" if m else "-", f"{m.mean_abs_logp_diff:.3e}" if m else "-",
    ]


def _summary(result: DemoResult) -> list[dict[str, Any]]:
    bf16_mb: float | None = None
    rows: list[dict[str, Any]] = []
    for arm in result.arms:
        recs = [r for r in result.of(arm) if r.report.ok]
        probes = [r.probe.metrics for r in recs if r.probe]
        mb = sum(r.report.bytes_sent for r in recs) / max(len(recs), 1) / 2**20
        bf16_mb = mb if arm == "BF16" else bf16_mb
        rows.append({
            "arm": arm, "refits_ok": len(recs), "mb_per_refit": mb,
            "refit_ms": 1e3 * sum(r.report.timings["total"] for r in recs) / max(len(recs), 1),
            # None (shown as "-"): nothing was measured, which is not a mismatch of 0
            "k3_kl": sum(p.k3_kl for p in probes) / len(probes) if probes else None,
            "mean_abs_logp_diff": sum(p.mean_abs_logp_diff for p in probes) / len(probes) if probes else None,
            "prob_diff_max": max((p.prob_diff_max for p in probes), default=None),
            "kv_scales_reset": max((r.report.kv_scales_reset for r in recs), default=0),
        })
    for row in rows:
        row["vs_bf16_bytes"] = row["mb_per_refit"] / bf16_mb if bf16_mb else None
    return rows


def _render(result: DemoResult, console: Console) -> None:
    s = result.settings
    console.print(
        f"[bold]refit demo[/bold]: plan {describe_plan(s.plan)} vs BF16 on {s.model} "
        f"({result.parameters / 1e6:.1f}M parameters, seed {s.seed}); {s.steps} steps, "
        f"{s.commit_mode} commits, {s.bucket_megabytes:g} MiB buckets"
    )
    table = Table(title="one row per arm and step (step 0 = initial sync)")
    for col in ("step", "arm", "outcome", "refit ms", "MB sent", "buckets", "storage", "serving", "k3 KL", "|dlogp|"):
        table.add_column(col, justify="right" if col not in ("arm", "outcome", "serving") else "left",
                         min_width=15 if col == "arm" else None)
    for r in result.records:
        table.add_row(*_row(r))
    console.print(table)
    comp = Table(title="comparison (mean over committed refits)")
    for col in ("arm", "MB/refit", "vs BF16", "refit ms", "k3 KL", "|dlogp|", "max |dp|", "KV resets"):
        comp.add_column(col, justify="left" if col == "arm" else "right")
    summary = _summary(result)
    for row in summary:
        live = row["refits_ok"] > 0  # an arm without a live refit sent and timed nothing to compare
        comp.add_row(str(row["arm"]), _cell(row["mb_per_refit"] if live else None, ".2f"),
                     _cell(row["vs_bf16_bytes"] if live else None, ".2f", "x"),
                     _cell(row["refit_ms"] if live else None, ".0f"), _cell(row["k3_kl"], ".3e"),
                     _cell(row["mean_abs_logp_diff"], ".3e"), _cell(row["prob_diff_max"], ".3e"),
                     str(row["kv_scales_reset"]))
    console.print(comp)
    for line in _failures(result) + _notes(result, summary):
        console.print(f"- {line}")


def _cell(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None else format(value, spec) + unit


def arms_without_live_refit(result: DemoResult) -> list[str]:
    """The arms none of whose refits went live: the demo measured nothing for them, and exits 1."""
    return [arm for arm in result.arms if not any(r.report.ok for r in result.of(arm))]


def _failures(result: DemoResult) -> list[str]:
    lines = []
    for r in result.records:
        if r.report.ok:
            continue
        line = f"step {r.step}, {r.arm}: {r.report.error}"
        if r.weights_unchanged is not None:
            verdict = "yes" if r.weights_unchanged else "no"
            line += f". Checked: live weights bit-identical to before the refit: {verdict}"
        lines.append(line)
    return lines


def _notes(result: DemoResult, summary: list[dict[str, Any]]) -> list[str]:
    notes = []
    bf16 = [r for r in result.of("BF16") if r.probe]
    if bf16:
        exact = all(r.probe.metrics.k3_kl == 0 and r.probe.metrics.mean_abs_logp_diff == 0 for r in bf16)  # type: ignore[union-attr]
        notes.append("BF16 refits: k3 KL = 0 and |dlogp| = 0 exactly (bit-identical weights and logits)"
                     if exact else "BF16 refits: NOT bit-identical (a bug: BF16 should be exact)")
    ranked = sorted((r for r in summary if r["k3_kl"] is not None), key=lambda r: r["k3_kl"])
    if ranked:
        notes.append("mismatch, lowest first: " + " < ".join(str(r["arm"]) for r in ranked))
    dead = arms_without_live_refit(result)
    if dead:
        notes.append(f"no refit of {', '.join(dead)} went live: nothing was measured there (exit status 1)")
    if result.fault_fired is False:
        notes.append(f"the injected fault {result.settings.inject_fault} never fired (fewer buckets than K?)")
    return notes


def _plot(result: DemoResult, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError("refit demo --plot needs matplotlib (pip install rl-refit[plot])", name="matplotlib") from err
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for arm in result.arms:
        recs = [r for r in result.of(arm) if r.probe]
        steps = [r.step for r in recs]
        axes[0].plot(steps, [r.probe.metrics.k3_kl for r in recs], marker="o", label=arm)  # type: ignore[union-attr]
        axes[1].plot(steps, [r.probe.metrics.mean_abs_logp_diff for r in recs], marker="o", label=arm)  # type: ignore[union-attr]
    for ax, title in zip(axes, ("k3 KL(rollout || trainer)", "mean |log p_trainer - log p_rollout|"), strict=True):
        ax.set_yscale("symlog", linthresh=1e-7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from app.bootstrap import DEMO_ENGINES
    from app.cli.demo_modes import resolve
    from app.logging import configure_logging
    from domain.errors import ConfigError, RefitError

    mode = resolve(args)  # every option set; one the mode does not take is refused, naming it
    configure_logging(json=args.json, level=logging.INFO if args.verbose else logging.CRITICAL)
    torch.set_num_threads(args.threads)
    if is_directory(args.model) and mode in ("procs", "qat", "megatron"):
        raise ConfigError("--model", f"a checkpoint directory does not go with `refit demo {mode}` (it builds the "
                          "embedded model); give an embedded model's name, or drop --model")
    real = mode in DEMO_ENGINES or getattr(args, "engine", None) in DEMO_ENGINES  # a real engine
    if real and mode in (*DEMO_ENGINES, "qat"):
        if mode == "qat":
            from app.cli.demo_qat import run_cli

            return run_cli(args)
        from app.cli.demo_engine import run_engine

        try:
            return run_engine(args)
        except RefitError:
            raise
        except ValueError as err:
            raise ConfigError(f"refit demo {mode}", str(err)) from None
    if mode == "lora" and not real and args.colocated:
        raise ConfigError("--colocated", f"goes with --engine {' or '.join(DEMO_ENGINES)} (the embedded engine always "
                          "runs in this process)")
    if mode == "lora" and real:  # the adapter mode into a real engine
        for flag, given in (("--presets", args.presets), ("--plot", args.plot is not None),
                            ("--commit-mode", args.commit_mode != "transactional"),
                            ("--inject-fault", args.inject_fault is not None)):
            if given:
                raise ConfigError(flag, f"is not an option of `refit demo lora --engine {args.engine}` (one engine, "
                                  f"the adapter mode, each adapter against {args.engine}'s own load of it); drop it")
        from app.cli.demo_lora import run_lora_engine

        return run_lora_engine(args)
    if mode == "qat":  # training with and without QAT (app.services.qat_demo)
        from app.cli.demo_qat import run_cli

        return run_cli(args)

    try:
        settings = settings_from_args(args)
    except RefitError:
        raise
    except ValueError as err:  # DemoSettings' own checks name the option
        raise ConfigError("refit demo", str(err)) from None
    if mode == "megatron":  # a real Megatron-Core trainer, sharded over processes
        from app.cli.demo_megatron import run_megatron

        return run_megatron(args, settings)
    if mode == "procs":  # trainer and engine ranks in separate processes
        from app.cli.demo_procs import run_procs

        return run_procs(args, settings)
    if settings.lora_sync == "adapter" and settings.lora_rank:  # the adapter alone each step (app.services.lora_demo)
        from app.cli.demo_lora import run_lora

        return run_lora(args, settings)
    result = run_demo(settings, arm_factory(settings))
    if args.plot:
        _plot(result, args.plot)
    if args.json:
        payload = {
            "model": settings.model, "parameters": result.parameters, "arms": list(result.arms),
            "settings": {**attrs.asdict(settings, recurse=False), "plan": describe_plan(settings.plan)},
            "steps": [r.to_dict() for r in result.records], "summary": _summary(result),
            "notes": _failures(result) + _notes(result, _summary(result)), "plot": args.plot,
        }
        sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
        return 1 if arms_without_live_refit(result) else 0
    console = Console(width=max(Console().width, 120))
    _render(result, console)
    if args.plot:
        console.print(f"- plot written to {args.plot}")
    return 1 if arms_without_live_refit(result) else 0
