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

from app.cli import options
from app.cli.demo_settings import arm_factory, settings_from_args
from app.services.demo import DemoResult, StepRecord, run_demo
from app.services.demo_config import EMBEDDED_MODELS, is_directory
from app.services.transaction import describe_plan


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`refit demo`'s arguments."""
    p.add_argument("--engine", default="reference", choices=("reference", "vllm"),
                   help="reference (embedded, default) or vllm: a real vLLM engine, each refit compared with a "
                        "cold start of the exported checkpoint")
    p.add_argument("--colocated", action="store_true",
                   help="with --engine vllm: the engine in this process (verl's hybrid engine) instead of its own")
    p.add_argument("--attach", metavar="URL", type=options.server_url, default=None,
                   help="with --engine vllm: refit the vLLM server you started at URL (docs/attach.md) instead of "
                        "starting one")
    p.add_argument("--linear", default=None,
                   help="preset for dense Linear layers, or BF16 (default FP8_BLOCK)")
    p.add_argument("--moe", default=None,
                   help="preset for routed experts, or BF16 (default NVFP4; FP8_BLOCK with --engine vllm)")
    p.add_argument("--moe-activation", default=None, help="experts' activation scheme (e.g. mxfp8); default: the preset's")
    p.add_argument("--linear-activation", default=None,
                   help="dense layers' activation scheme (none = weight-only, e.g. NVFP4 on vLLM); default: the preset's")
    p.add_argument("--steps", type=options.steps, default=None,
                   help="training-like steps after the initial sync (default 3; 2 with --engine vllm)")
    p.add_argument("--model", default=None, metavar="NAME|DIR", type=options.model_or_directory(EMBEDDED_MODELS),
                   help="embedded model (tiny-moe, tiny-dense, micro-moe, micro-dense; default tiny-moe, micro-moe "
                        "with --engine vllm), or DIR: your Hugging Face checkpoint directory (Qwen3 / Qwen3-MoE "
                        "for the reference engine, any model vLLM serves with --engine vllm)")
    p.add_argument("--commit-mode", default="transactional", choices=("transactional", "per-layer"))
    p.add_argument("--bucket-mb", type=options.mebibytes(), default=1.0, help="bucket capacity in MiB (default 1)")
    p.add_argument("--inject-fault", metavar="FAULT", default=None,
                   help="[hang:]POINT: bucket:K, begin, finalize, verify or storage (with --procs also "
                        "export:K): make the plan's refit fail there once")
    p.add_argument("--fault-step", type=options.steps, default=1, help="the step whose refit the fault hits (default 1)")
    p.add_argument("--presets", action="store_true", help="add one arm per low-precision preset")
    p.add_argument("--plot", metavar="PNG", type=options.plot_file, default=None,
                   help="draw the mismatch per step for every preset (.png, .pdf or .svg)")
    p.add_argument("--seed", type=options.seed, default=0, help=f"seed of the random weights, 0 to {options.MAX_SEED}")
    p.add_argument("--threads", type=options.threads, default=1,
                   help="torch intra-op threads (default 1: the embedded model's ops are too small to gain from more)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="log the canonical line of every refit (stderr), and the notices of third-party packages")
    p.add_argument("--qat", nargs="?", const="NVFP4", default=None, metavar="PRESET",
                   help="train with QAT in PRESET (default NVFP4) and without; compare k3 KL against the rollout "
                        "(with --engine vllm: a vLLM engine in this process, 4-bit presets on the experts)")
    p.add_argument("--lora", type=options.integer(1, 512), default=None, metavar="RANK",
                   help="train a LoRA adapter of rank RANK on the embedded model (the steps move only the adapter)")
    p.add_argument("--lora-sync", choices=("merged", "adapter"), default=None,
                   help="with --lora: merged (default; W + (alpha/r) B A refitted whole) or adapter (the adapter alone "
                        "each step, the base once)")
    p.add_argument("--procs", type=int, default=None, metavar="N",
                   help="run trainer and engine ranks in N processes (2-4) over gloo on 127.0.0.1")
    p.add_argument("--fault-rank", type=int, default=None, metavar="R",
                   help="with --procs: the rank --inject-fault hits (default: the last engine; rank 0 for export:K)")
    from app.cli.demo_megatron import add_arguments

    add_arguments(p)


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


def _check_engine_options(args: argparse.Namespace) -> None:
    from domain.errors import ConfigError

    for flag, given in (("--procs", args.procs is not None), ("--fault-rank", args.fault_rank is not None),
                        ("--presets", args.presets),
                        ("--plot", args.plot is not None), ("--commit-mode", args.commit_mode != "transactional"),
                        ("--trainer", args.trainer != "reference")):
        if given:
            raise ConfigError(flag, f"does not go with --engine {args.engine} (a real engine runs one plan, "
                              "committing per layer)")
    if args.qat is None:
        return
    for flag, given in (("--attach", args.attach is not None), ("--inject-fault", args.inject_fault is not None),
                        ("--linear", args.linear is not None), ("--moe", args.moe is not None),
                        ("--moe-activation", args.moe_activation is not None),
                        ("--linear-activation", args.linear_activation is not None)):
        if given:
            raise ConfigError(flag, f"does not go with --qat on --engine {args.engine}: the QAT demo starts one "
                              "engine in this process and serves the QAT preset where the engine serves it "
                              "(docs/qat.md); drop it")


def run(args: argparse.Namespace) -> int:
    from app.logging import configure_logging

    configure_logging(json=args.json, level=logging.INFO if args.verbose else logging.CRITICAL)
    if args.threads < 1:
        from domain.errors import ConfigError

        raise ConfigError("--threads", f"must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    from domain.errors import ConfigError, RefitError

    if is_directory(args.model):
        for flag, given in (("--procs", args.procs is not None), ("--qat", args.qat is not None),
                            ("--trainer", args.trainer != "reference")):
            if given:
                raise ConfigError("--model", f"a checkpoint directory does not go with {flag} (those demos build "
                                  "the embedded model); drop one of them")

    if args.lora_sync is not None and args.lora is None:
        raise ConfigError("--lora-sync", "goes with --lora RANK (the adapter's rank)")
    if args.lora is not None:
        for flag, given in (("--engine", args.engine != "reference"), ("--procs", args.procs is not None),
                            ("--qat", args.qat is not None), ("--trainer", args.trainer != "reference")):
            if given:
                raise ConfigError("--lora", f"the LoRA demo trains the embedded model in this process, into the "
                                  f"embedded engine; it does not go with {flag}")
    if args.engine != "reference":  # a real engine (app.services.engine_demo, or qat_demo with --qat)
        _check_engine_options(args)
        if args.qat:
            from app.cli.demo_qat import run_cli

            return run_cli(args)
        from app.cli.demo_engine import run_engine

        try:
            return run_engine(args)
        except RefitError:
            raise
        except ValueError as err:
            raise ConfigError("refit demo", str(err)) from None
    if args.colocated or args.attach:
        flag = "--colocated" if args.colocated else "--attach"
        raise ConfigError(flag, "goes with --engine vllm (the reference engine always runs in this process)")
    if args.fault_rank is not None and args.procs is None:
        raise ConfigError("--fault-rank", "goes with --procs N (it names the rank of the process world that "
                          "--inject-fault hits); add --procs, or drop --fault-rank")
    if args.qat:  # training with and without QAT (app.services.qat_demo)
        if args.trainer != "reference":
            raise ConfigError("--qat", f"does not go with --trainer {args.trainer} (the QAT demo trains two copies "
                              "of the embedded model in this process)")
        from app.cli.demo_qat import run_cli

        return run_cli(args)

    try:
        settings = settings_from_args(args)
    except RefitError:
        raise
    except ValueError as err:  # DemoSettings' own checks name the option
        raise ConfigError("refit demo", str(err)) from None
    from app.cli.demo_megatron import check_reference_args, run_megatron

    if args.trainer == "megatron":  # a real Megatron-Core trainer, sharded over processes
        return run_megatron(args, settings)
    check_reference_args(args)
    if args.procs is not None:  # trainer and engine ranks in separate processes
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
