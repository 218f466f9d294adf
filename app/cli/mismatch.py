"""`refit mismatch [--model NAME|DIR] [--engine embedded|vllm] [--preset P ...] [--json] [--plot PNG]`:
the trainer's log-probs against the rollout's, per preset, under verl's metric names
(app.services.mismatch_report)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable

import attrs
from rich.console import Console
from rich.table import Table

from app.cli import options
from app.config_sections import CheckpointEngineConfig, RefitConfig, RolloutConfig
from app.services.demo_config import EMBEDDED_MODELS, model_config
from app.services.mismatch_report import MismatchResult, MismatchSettings, presets_of, run_mismatch
from domain.mismatch import IS_LEVELS, RS_LEVELS
from domain.mismatch_sentinel import DEFAULT_K3_THRESHOLD
from domain.quant.plan import QuantizationPlan

EMBEDDED = "embedded"  # --engine's default: the reference engine in this process (rollout.name=reference)
# The presets the embedded engine scores by default: every one. A real engine scores its plugin's
# (adapters.engine_plugin.DemoDefaults.mismatch_presets: those its CPU build serves for dense and
# MoE models alike; name others with --preset where they serve).
EMBEDDED_PRESETS = ("BF16", "FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4")
COLUMNS = ("rollout_corr/k3_kl", "rollout_corr/kl", "rollout_corr/rollout_is_mean", "training/rollout_logprobs_diff_mean",
           "training/rollout_probs_diff_max")


def _level(choices: tuple[str, ...]) -> Callable[[str], str | None]:
    def parse(text: str) -> str | None:
        value = text.strip().lower()
        if value == "none":
            return None
        if value not in choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)} or none, got {text!r}")
        return value

    return parse


def _positive(text: str) -> float:
    try:
        value = float(text) if len(text) <= 40 else float("nan")
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`refit mismatch`'s arguments."""
    p.add_argument("--model", default=None, metavar="NAME|DIR", type=options.model_or_directory(EMBEDDED_MODELS),
                   help="embedded model (tiny-moe, tiny-dense, micro-moe, micro-dense; default tiny-moe, micro-moe "
                        "with --engine vllm), or DIR: a Hugging Face checkpoint directory")
    p.add_argument("--engine", default=EMBEDDED, choices=(EMBEDDED, "vllm"),
                   help="embedded (default: the reference engine in this process) or vllm (a real vLLM engine, "
                        "one per preset, each closed before the next starts)")
    p.add_argument("--colocated", action="store_true",
                   help="with --engine vllm and one --preset: the engine in this process")
    p.add_argument("--preset", action="append", default=None, metavar="NAME|LINEAR/MOE",
                   help="a preset to score (repeatable): NAME for dense Linear and experts alike, or LINEAR/MOE "
                        "(e.g. BF16/MXFP4); default: every preset on embedded, BF16, FP8_BLOCK, MXFP8 on vllm")
    p.add_argument("--rollout-is", type=_level(IS_LEVELS), default="token", metavar="LEVEL",
                   help="verl's truncated IS weights (TIS): token (default), sequence or none")
    p.add_argument("--rollout-rs", type=_level(RS_LEVELS), default="token", metavar="LEVEL",
                   help="verl's masked IS (MIS, rejection): token (default), sequence, geometric or none")
    p.add_argument("--threshold", type=_positive, default=2.0,
                   help="rollout_is_threshold and rollout_rs_threshold (default 2.0, verl's)")
    p.add_argument("--kl-threshold", type=_positive, default=DEFAULT_K3_THRESHOLD,
                   help=f"the mismatch sentinel's k3 KL spike threshold (default {DEFAULT_K3_THRESHOLD:g})")
    p.add_argument("--seed", type=options.seed, default=0, help="seed of the embedded model's weights and the tokens")
    p.add_argument("--plot", metavar="PNG", type=options.plot_file, default=None,
                   help="draw k3 KL and the mean log-prob difference per preset (.png, .pdf or .svg)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def mismatch_config(engine: str, model: str, seed: int, *, colocated: bool) -> RefitConfig:
    """The configuration `refit mismatch` scores on: the demo's for a real engine (the trainer's
    model, the engine started from its config.json with dummy weights), the embedded engine in
    this process otherwise."""
    if engine == EMBEDDED:
        rollout = RolloutConfig(name="reference", checkpoint_engine=CheckpointEngineConfig())
        return model_config(model, seed, RefitConfig(rollout=rollout))
    from app.services.demo_config import engine_config
    from app.services.engine_demo import EngineDemoSettings

    settings = EngineDemoSettings(engine=engine, deployment="colocated" if colocated else "disaggregated",
                                  plan=QuantizationPlan.bf16(), model=model, seed=seed)
    return engine_config(settings, CheckpointEngineConfig().update_weights_bucket_megabytes)


def _render(result: MismatchResult, console: Console) -> None:
    console.print(f"[bold]refit mismatch[/bold]: engine {result.engine}, model {result.model}, "
                  f"{result.tokens} response tokens scored per preset")
    table = Table(title="trainer (old) against rollout log-probs, verl's metric names")
    for col in ("preset", *COLUMNS, "sentinel"):
        table.add_column(col, justify="left" if col in ("preset", "sentinel") else "right")
    for row in result.rows:
        values = [f"{row.metrics[c]:.4g}" for c in COLUMNS] if row.metrics else ["-"] * len(COLUMNS)
        verdict = "SPIKE" if row.alarm else ("armed" if row.sentinel.startswith("mismatch sentinel armed") else "off")
        table.add_row(row.label, *values, verdict if not row.error else "-")
    console.print(table)
    for row in result.rows:
        if row.error:
            console.print(f"- {row.label}: not scored: {row.error}")
        elif row.alarm:
            console.print(f"- {row.label}: {row.alarm}")


def _plot(result: MismatchResult, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError("refit mismatch --plot needs matplotlib (pip install rl-refit[plot])",
                                  name="matplotlib") from err
    rows = [r for r in result.rows if r.metrics]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key in zip(axes, ("rollout_corr/k3_kl", "training/rollout_logprobs_diff_mean"), strict=True):
        ax.bar([r.label for r in rows], [r.metrics[key] for r in rows])
        ax.set_yscale("symlog", linthresh=1e-7)
        ax.set_title(key)
        ax.tick_params(axis="x", rotation=30)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{result.engine}, {result.model}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from app.bootstrap import DEMO_ENGINES, bootstrap, demo_of
    from app.logging import configure_logging
    from domain.errors import ConfigError

    configure_logging(json=args.json, level=logging.INFO if getattr(args, "verbose", False) else logging.CRITICAL)

    real = args.engine in DEMO_ENGINES
    if args.colocated and not real:
        raise ConfigError("--colocated", f"goes with --engine {' or '.join(DEMO_ENGINES)} (the embedded engine always "
                          "runs in this process)")
    demo = demo_of(args.engine) if real else None
    model = args.model or (demo.model if demo is not None else "tiny-moe")
    defaults = demo.mismatch_presets if demo is not None else EMBEDDED_PRESETS
    settings = MismatchSettings(presets_of(args.preset, defaults), seed=args.seed,
                                rollout_is=args.rollout_is, rollout_rs=args.rollout_rs, threshold=args.threshold,
                                kl_threshold=args.kl_threshold)
    if args.colocated and demo is not None and demo.one_per_process and len(settings.presets) > 1:
        raise ConfigError("--colocated", f"scores one preset per run ({len(settings.presets)} asked): an engine in "
                          "this process owns its state for the process's life; name one --preset, or drop --colocated")
    services = bootstrap(mismatch_config(args.engine, model, args.seed, colocated=args.colocated))
    result = run_mismatch(services, settings, engine_label=args.engine, model=model)
    if args.plot:
        _plot(result, args.plot)
    if args.json:
        sys.stdout.write(json.dumps({**result.to_dict(), "settings": _settings(settings), "plot": args.plot},
                                    indent=2) + "\n")
    else:
        _render(result, Console(width=max(Console().width, 190)))
        if args.plot:
            print(f"- plot written to {args.plot}")
    return 0 if result.ok else 1


def _settings(settings: MismatchSettings) -> dict[str, object]:
    out = attrs.asdict(settings, recurse=False)
    out["presets"] = [label for label, _ in settings.presets]
    return out
