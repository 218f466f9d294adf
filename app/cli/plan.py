"""`refit plan [CONFIG] [KEY=VALUE ...] [--model DIR]`: validate a configuration and show every decision."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from typing import TYPE_CHECKING, Any

import attrs
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from app.config import RefitConfig, load_config
from app.services.planning import PlanReport
from domain.errors import ConfigError, RefitError
from domain.quant import naming
from domain.quant.numerics import numerics_decisions

if TYPE_CHECKING:
    from app.bootstrap import Services
    from domain.quant.backend_policy import BackendDecision


def add_config_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments `plan` and `export` share: an optional YAML file and KEY=VALUE overrides."""
    p.add_argument("args", nargs="*", metavar="[CONFIG] [KEY=VALUE]",
                   help="a YAML configuration file, then dotted overrides such as rollout.quantization.linear=FP8_BLOCK")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def config_from_args(args: argparse.Namespace) -> RefitConfig:
    """Load the configuration named by the positional arguments (file first, then overrides)."""
    source, overrides = split_config_args(args)
    return load_config(source, overrides)


def services_from_args(args: argparse.Namespace, model: str | None = None) -> Services:
    """The composition root's services for the positional arguments (and `--model DIR`, which
    wins over model.path; an empty or blank one is a ConfigError, never "no --model")."""
    from app.bootstrap import bootstrap

    if model is not None and not model.strip():
        raise ConfigError("--model", f"{model!r} is empty or blank (an unset shell variable?); name the checkpoint "
                          "directory")
    config = config_from_args(args)
    if model:
        config = attrs.evolve(config, model=attrs.evolve(config.model, path=model))
    return bootstrap(config)


def split_config_args(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """The positional arguments as (YAML file or None, overrides)."""
    items = list(args.args)
    source = items.pop(0) if items and "=" not in items[0] else None
    return source, items


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`refit plan`'s arguments."""
    add_config_arguments(p)
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (sets model.path); per-tensor decisions")
    p.add_argument("--all", action="store_true", help="one row per tensor instead of per tensor class")


def tensor_class(name: str) -> str:
    """`model.layers.3.mlp.experts.7.up_proj.weight` -> `model.layers.*.mlp.experts.*.up_proj.weight`."""
    return re.sub(r"\.\d+(?=\.)", ".*", name)


def _plan_dict(report: PlanReport) -> dict[str, Any]:
    plan, res = report.plan, report.resolution
    return {
        "linear": plan.linear.name,
        "linear_activation": plan.effective_linear_activation.value,
        "moe": plan.moe.name,
        "moe_activation": plan.effective_moe_activation.value,
        "ignore": list(plan.ignore),
        "numerics": plan.numerics.value,
        "scale_rule": None if plan.scale_rule is None else plan.scale_rule.value,
        "scale_name": plan.scale_name,
        "source": res.source,
        "layout": res.layout,
        "quantized": res.is_quantized,
        "config_as_written": res.as_written,
        "decoded": dict(report.decoded),
    }


def _classes(report: PlanReport) -> list[dict[str, Any]]:
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    counts: Counter[tuple[str, str, str]] = Counter()
    for d in report.decisions:
        key = (tensor_class(d.name), d.format.name, d.reason)
        counts[key] += 1
        rows.setdefault(key, {"tensors": tensor_class(d.name), "format": d.format.name, "kind": d.kind,
                              "group": tensor_class(d.group) if d.group else None, "reason": d.reason})
    return [{**row, "count": counts[key]} for key, row in rows.items()]


EMBEDDED = "reference"  # rollout.name of the embedded engine, rl-refit's default (verl's is vllm)


def checked_engine(engine: str) -> str:
    """The first line's account of the engine a plan was checked against."""
    if engine == EMBEDDED:
        return "the embedded engine (rollout.name=reference; verl's default is vllm: add rollout.name=vllm)"
    return f"engine {engine}"


def backends(services: Services, report: PlanReport) -> BackendDecision | None:
    """The kernels each role asks the engine for (None: the engine has no kernel choice, e.g. the
    embedded engine's pure torch)."""
    return services.engines.planned_backends(report.engine, report.plan)


def _backends_dict(decision: BackendDecision | None) -> dict[str, Any] | None:
    if decision is None:
        return None
    return {**{c.role: {"backend": c.backend, "reason": c.reason} for c in decision.choices},
            "deep_gemm_e8m0": decision.deep_gemm_e8m0, "opted_out": decision.opted_out, "notes": list(decision.notes)}


def to_json(report: PlanReport, decision: BackendDecision | None = None) -> dict[str, Any]:
    """The machine-readable form of a PlanReport (and the engine's backend decision)."""
    return {
        "engine": report.engine,
        "checked": checked_engine(report.engine),
        "backends": _backends_dict(decision),
        "plan": _plan_dict(report),
        "numerics": [d.to_dict() for d in numerics_decisions(report.plan)],
        "rules": [{"rule": o.rule, "check": o.summary, "outcome": o.outcome} for o in report.resolution.outcomes],
        "engine_config": report.engine_config,
        "unused_keys": list(report.unused_keys),
        "tensor_classes": _classes(report),
        "tensors": [
            {"name": d.name, "format": d.format.name, "kind": d.kind, "group": d.group, "reason": d.reason}
            for d in report.decisions
        ],
    }


def decoded_note(decoded: dict[str, int]) -> str:
    """What happens to the modules a source stores quantized, in words."""
    found = ", ".join(f"{n} module{'s' if n != 1 else ''} stored as {fmt}" for fmt, n in sorted(decoded.items()))
    return f"{found}: decoded to dense weights, then quantized (or kept) as the plan says"


def render(report: PlanReport, console: Console, *, every_tensor: bool = False,
           decision: BackendDecision | None = None) -> None:
    """Print a PlanReport as rich tables (every value escaped: `[...]` in an ignore list or a
    regex is text, not rich markup)."""
    p = _plan_dict(report)
    console.print(f"[bold]refit plan[/bold]: checked {escape(checked_engine(report.engine))}, layout "
                  f"[bold]{p['layout']}[/bold] (from {escape(p['source'])}), quantized: {p['quantized']}",
                  soft_wrap=True)  # one line, whatever the terminal's width: scripts and docs read it
    if report.decoded:
        console.print(escape(f"source: {decoded_note(report.decoded)}"))
    summary = Table(title="rollout quantization")
    for col in ("tensor class", "preset", "activations"):
        summary.add_column(col)
    summary.add_row("dense Linear", p["linear"], p["linear_activation"])
    summary.add_row("routed experts", p["moe"], p["moe_activation"])
    console.print(summary)
    ignore = naming.yaml_list(p["ignore"]) if p["ignore"] else "none"
    console.print(escape(f"ignore (besides the defaults): {ignore}; block scale name {p['scale_name']}"))
    _render_numerics(report, console)
    rules = Table(title="dispatch rules")
    for col in ("rule", "check", "outcome"):
        rules.add_column(col)
    for o in report.resolution.outcomes:
        rules.add_row(o.rule, escape(o.summary), escape(o.outcome))
    console.print(rules)
    _render_backends(report, decision, console)
    if report.decisions:
        table = Table(title="tensors" if every_tensor else "tensor classes")
        for col in ("tensors", "count", "kind", "format", "fused group", "reason"):
            table.add_column(col, overflow="fold")
        rows = ([{"tensors": d.name, "count": 1, "kind": d.kind, "format": d.format.name, "group": d.group,
                  "reason": d.reason} for d in report.decisions] if every_tensor else _classes(report))
        for r in rows:
            table.add_row(*(escape(str(r[k] or "-")) for k in ("tensors", "count", "kind", "format", "group", "reason")))
        console.print(table)
    else:
        console.print("[dim]no model given (--model DIR or model.path): per-tensor decisions and the model's "
                      "rules (UniformFusedGroups, FirstLastLayersBf16, BlockDivisibility) skipped[/dim]")
    if report.unused_keys:
        shown = ", ".join(report.unused_keys[:6]) + (", ..." if len(report.unused_keys) > 6 else "")
        console.print(f"[dim]{len(report.unused_keys)} keys of the verl configuration are not read by rl-refit: "
                      f"{shown}[/dim]")
    written = " (as written)" if report.resolution.as_written else ""
    console.print(f"engine quantization_config{written}:" if report.engine_config
                  else "engine quantization_config: none (BF16)")
    if report.engine_config:
        console.print_json(json.dumps(report.engine_config))


def _render_backends(report: PlanReport, decision: BackendDecision | None, console: Console) -> None:
    if decision is None:
        console.print(escape(f"backends: {report.engine} computes in pure torch; no kernel to choose"))
        return
    table = Table(title=f"backend decision ({report.engine})")
    for col in ("role", "asks for", "why"):
        table.add_column(col, overflow="fold")
    for c in decision.choices:
        table.add_row(c.role, escape(c.backend), escape(c.reason))
    console.print(table)
    for note in decision.notes:
        console.print(escape(f"backends: {note}"))


def _render_numerics(report: PlanReport, console: Console) -> None:
    decisions = numerics_decisions(report.plan)
    if not decisions:
        return
    table = Table(title=f"numerics: element rule {report.plan.numerics.value}")
    for col in ("format", "quantizes", "MX scale rule", "reference"):
        table.add_column(col, overflow="fold")
    for d in decisions:
        scale = "-" if d.scale_rule is None else f"{d.scale_rule.value} ({d.scale_reason})"
        table.add_row(d.format.name, ", ".join(d.roles), scale, d.spec.reference)
    console.print(table)
    console.print(f"why: {decisions[0].element_reason}")
    for d in decisions:
        console.print(f"{d.format.name}: {d.spec.formula}")


def run(args: argparse.Namespace) -> int:
    try:
        services = services_from_args(args, args.model)
        services.check_environment()  # VERL_FUSED_USE_OP_HOOK, VERL_ROLLOUT_USE_DEEP_GEMM
        report = services.plan_report(services.checkpoint())
        decision = backends(services, report)
    except RefitError as err:
        if args.json:
            sys.stdout.write(json.dumps({"error": {"type": type(err).__name__, "message": str(err)}}) + "\n")
        raise
    if args.json:
        sys.stdout.write(json.dumps(to_json(report, decision), indent=2) + "\n")
    else:
        render(report, Console(), every_tensor=args.all, decision=decision)
    return 0
