"""`refit demo megatron --tp T --pp P [--ep E] [--etp X]`: a real, sharded Megatron-Core
trainer trains the demo model a few steps on CPU and refits the engine after every step.

The processes join one gloo world on 127.0.0.1: the trainer's T x P (x E, carved out of the
stages' ranks) ranks run Megatron-Core, one more runs the reference engine
(app.services.megatron_demo). Every refit is judged against the trainer's own current weights,
gathered from every rank into the unsharded model (Megatron's own checkpoint metadata places
them): the engine must hold exactly what a single-process refit of that model's export gives it,
the BF16 arm's log-probs must equal the reference engine's forward on those weights (k3 KL = 0
exactly), and Megatron's own forward must stay within a documented bound of the engine's
(`MEGATRON_K3_BOUND`). The exit status is 0 when every refit of every step holds, 1 otherwise
(text and JSON alike).
With `--engine vllm`, the engine rank starts a vLLM server instead, the plan's arm alone runs,
and every refit is judged against a cold start of the unsharded model's export (prompt
log-probs, greedy tokens and every digest, bit for bit: app.services.megatron_demo.judge_cold_starts).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from app.bootstrap import bootstrap
from app.cli.demo_settings import (
    REAL_ENGINE_PHASE_TIMEOUT_S,
    REAL_ENGINE_STEP_TIMEOUT_S,
    demo_config,
    raise_typed_failure,
    real_engine_settings,
    starting_servers,
)
from app.config_sections import ActorConfig, MegatronConfig, ReferenceConfig, RefitConfig
from app.services.demo import DemoSettings
from app.services.demo_config import engine_config
from app.services.transaction import describe_plan
from domain.errors import ConfigError

if TYPE_CHECKING:  # the Megatron demo's service loads only when `refit demo megatron` runs
    from app.services.engine_demo import EngineDemoSettings
    from app.services.megatron_demo import MegatronDemoSettings

MAX_TRAINER_RANKS = 4  # this machine: 2 cores


def check_layout(services: Any, world: Any, settings: DemoSettings) -> None:
    """The embedded model's heads, experts and tensors split evenly over the layout: checked here,
    before any rank starts, so that a layout Megatron-Core refuses ends in one line naming the
    option (each rank's own check would end in a traceback per rank)."""
    from domain.refit.shard_map import ShardMap

    cfg, layout = services.embedded.reference_config(), world.layout
    for flag, size, count, what in (("--tp", layout.tp, cfg.num_heads, "attention heads"),
                                    ("--tp", layout.tp, cfg.num_kv_heads, "key/value heads"),
                                    ("--pp", layout.pp, cfg.num_layers, "layers"),
                                    ("--ep", layout.ep, cfg.num_experts, "routed experts")):
        if count % size:
            raise ConfigError(flag, f"{size} does not divide the {count} {what} of {settings.model}; use a divisor "
                              f"of {count}")
    ShardMap.build(layout, services.embedded.reference_shapes(), settings.plan)  # every tensor's split; ShardingError names the key


def run_megatron(args: argparse.Namespace, settings: DemoSettings) -> int:
    """Run the Megatron demo world, judge every refit, print; the exit status."""
    from app.services.megatron_demo import (
        MEGATRON_K3_BOUND,
        MegatronDemoSettings,
        judge,
        probe_batch,
        step_pieces,
        verdict,
    )

    engine = real_engine_settings(args, settings)
    if engine is not None:  # the engine's defaults (its plugin's preset and model, 2 steps)
        settings = attrs.evolve(settings, plan=engine.plan, model=engine.model, steps=engine.steps)
    megatron = MegatronConfig(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                              expert_model_parallel_size=args.ep, expert_tensor_parallel_size=args.etp)
    base = demo_config(settings) if engine is None else engine_config(engine, settings.bucket_megabytes)
    config = attrs.evolve(base, actor=ActorConfig(strategy="megatron", megatron=megatron),
                          reference=ReferenceConfig(model=settings.model, seed=settings.seed))
    services = bootstrap(config)
    world = services.world.refit_world(engines=1)
    if world.layout.size > MAX_TRAINER_RANKS:
        raise ConfigError("--tp/--pp/--ep", f"{world.layout.describe()} needs {world.layout.size} trainer processes; "
                          f"this machine runs at most {MAX_TRAINER_RANKS} (use --etp 1 to carve --ep out of --tp)")
    check_layout(services, world, settings)
    demo = MegatronDemoSettings(settings.plan, describe_plan(settings.plan), steps=settings.steps, lr=args.lr,
                                seed=settings.seed)
    if engine is not None:  # the engine rank starts its server and reads what it serves after each refit
        from app.services.engine_demo import ServedBatch

        demo = attrs.evolve(demo, served=ServedBatch.of(services.embedded.reference_config().vocab_size, engine),
                            step_timeout_s=REAL_ENGINE_STEP_TIMEOUT_S, phase_timeout_s=REAL_ENGINE_PHASE_TIMEOUT_S)
    # Every world starts from a clean process (forkserver): Megatron worlds must not inherit the
    # state of a process that ran Megatron itself (a caller's, or a test's).
    timeout = 180 + 30 * settings.steps if engine is None else 900 + 120 * settings.steps
    if engine is not None and not args.json:
        sys.stderr.write(starting_servers(engine.engine, world.engines))
    results = services.world.launch_world(_demo_rank, world.size, (config, demo, world), timeout_s=timeout,
                                          start_method="forkserver")
    if _crashed(results):
        return 1
    records = [rec for r in results for rec in r.value]
    pieces = step_pieces(records)
    reference = services.world.launch_world(_unsharded_rank, 1, (config, pieces, probe_batch(services, demo)),
                                      timeout_s=120 + 20 * len(pieces), start_method="forkserver")
    if _crashed(reference):
        return 1
    if engine is not None:
        return _on_engine(args, services, engine, demo, world, records, reference[0].value)
    rows = judge(services, demo, world, records, reference[0].value)
    checks = verdict(rows)
    header = (f"refit demo megatron: {settings.model} as a Megatron-Core GPTModel, trainer "
              f"{world.layout.describe()} on ranks {list(world.trainer_ranks)}, reference engine on rank "
              f"{list(world.engine_ranks)}, gloo on 127.0.0.1; plan {demo.plan_name} and BF16, {settings.steps} steps")
    if args.json:
        payload = {"header": header, "world": {"layout": world.layout.describe(), "trainer_ranks": world.layout.size,
                                               "engines": world.engines}, "refits": rows,
                   "megatron_k3_kl_max": _megatron_max(rows), "megatron_k3_kl_bound": MEGATRON_K3_BOUND, **checks}
        sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
    else:
        _render(header, rows, checks)
    return 0 if all(checks.values()) else 1


def _on_engine(args: argparse.Namespace, services: Any, engine: EngineDemoSettings, demo: MegatronDemoSettings,
               world: Any, records: list[dict[str, Any]], unsharded: Any) -> int:
    """A real engine's verdicts (each refit against a cold start of the unsharded model's export),
    printed; the exit status."""
    from app.services.engine_demo import ColdStartComparer
    from app.services.megatron_demo import cold_start_verdict, judge_cold_starts

    with tempfile.TemporaryDirectory(prefix="rl-refit-demo-megatron-") as tmp:
        comparer = ColdStartComparer(services, services.embedded.reference_config().vocab_size, engine, Path(tmp))
        rows = judge_cold_starts(comparer, demo, records, unsharded)
    checks = cold_start_verdict(rows)
    header = (f"refit demo megatron: {engine.model} as a Megatron-Core GPTModel, trainer {world.layout.describe()} on "
              f"ranks {list(world.trainer_ranks)}, a {engine.engine} server started by rank {world.engine_ranks[0]}, "
              f"gloo on 127.0.0.1; plan {demo.plan_name}, {demo.steps} steps")
    if args.json:
        payload = {"header": header, "engine": engine.engine,
                   "world": {"layout": world.layout.describe(), "trainer_ranks": world.layout.size,
                             "engines": world.engines}, "refits": rows, **checks}
        sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
        return 0 if all(checks.values()) else 1
    console = Console(width=max(Console().width, 120))
    console.print(header)
    table = Table(title="one row per step (step 0 = initial sync); each refit against a cold start of its export")
    for col in ("step", "loss", "outcome", "refit ms", "MB sent", "= cold start", "max |dlogp|"):
        table.add_column(col, justify="left" if col == "outcome" else "right")
    for r in rows:
        loss = f"{r['loss']:.3f}" if r["loss"] is not None else "-"
        diff = r["max_abs_logp_diff"]
        table.add_row(str(r["step"]), loss, r["outcome"], f"{r['refit_ms']:.0f}", f"{r['mb_sent']:.2f}",
                      "yes" if r["equals_cold_start"] else "NO", f"{diff:.3g}" if diff is not None else "-")
    console.print(table)
    for text in dict.fromkeys(e for r in rows for e in r["errors"]):
        console.print(f"- failure: {escape(text)}")
    for r in rows:
        for e in r["engines"]:
            if e["equals_cold_start"] is False:
                console.print(f"- step {r['step']}, rank {e['rank']}: differs from the cold start: log-probs equal "
                              f"{e['logprobs_equal']}, tokens equal {e['tokens_equal']}, weights differing "
                              f"{e['differing_weights']}")
    unreadable = sorted({n for r in rows for e in r["engines"] for n in e.get("unreadable", ())})
    if unreadable:
        console.print(f"- {len(unreadable)} weights were not compared byte for byte: the engine keeps them packed "
                      "outside their (empty) parameter; the log-probs and greedy tokens check them")
    if demo.steps:
        console.print("- the refit ms from step 1 on include the trainer ranks' wait for the engine rank, which reads "
                      "what its server serves after each refit")
    console.print(f"- every refit went live, and the {engine.engine} server equals a cold start of the unsharded "
                  f"model's export after each, bit for bit: {'yes' if all(checks.values()) else 'NO'}")
    return 0 if all(checks.values()) else 1


def _demo_rank(rank: int, config: RefitConfig, demo: MegatronDemoSettings, world: Any) -> list[dict[str, Any]]:
    from app.services.megatron_demo import demo_rank

    return demo_rank(rank, bootstrap(config), demo, world)


def _unsharded_rank(rank: int, config: RefitConfig, pieces: Any, probe: Any) -> Any:
    from app.services.megatron_demo import unsharded_rank

    return unsharded_rank(rank, bootstrap(config), pieces, probe)


def _crashed(results: list[Any]) -> bool:
    raise_typed_failure(results)
    crashed = [r for r in results if not r.ok]
    if crashed:
        text = "\n".join(f"rank {r.rank}: {r.error}\n{r.traceback or ''}{r.output[-1500:]}" for r in crashed)
        sys.stderr.write(f"refit demo megatron: a rank did not finish:\n{text}\n")
    return bool(crashed)


def _megatron_max(rows: list[dict[str, Any]]) -> float | None:
    """The largest k3 KL of Megatron's forward against the engine's on the BF16 arm."""
    from app.services.megatron_demo import BF16

    figures = [r["megatron_k3_kl"] for r in rows if r["arm"] == BF16 and "megatron_k3_kl" in r]
    return max(figures) if figures else None


def _render(header: str, rows: list[dict[str, Any]], checks: dict[str, bool]) -> None:
    from app.services.megatron_demo import MEGATRON_K3_BOUND

    console = Console(width=max(Console().width, 120))
    console.print(header)
    table = Table(title="one row per step and arm (step 0 = initial sync)")
    for col in ("step", "arm", "loss", "outcome", "refit ms", "MB sent", "= unsharded", "k3 KL", "|dlogp|", "Megatron k3"):
        table.add_column(col, justify="left" if col in ("arm", "outcome") else "right")
    for r in rows:
        loss = f"{r['loss']:.3f}" if r["loss"] is not None else "-"
        table.add_row(str(r["step"]), r["arm"], loss, r["outcome"], f"{r['refit_ms']:.0f}", f"{r['mb_sent']:.2f}",
                      "yes" if r["sharded_equals_unsharded"] else "NO", f"{r.get('k3_kl', float('nan')):.3e}",
                      f"{r.get('mean_abs_logp_diff', float('nan')):.3e}", f"{r.get('megatron_k3_kl', float('nan')):.3e}")
    console.print(table)
    for text in dict.fromkeys(e for r in rows for e in r["errors"]):
        console.print(f"- failure: {escape(text)}")
    console.print(f"- every engine holds exactly the single-process refit of the unsharded model: "
                  f"{'yes' if checks['sharded_equals_unsharded'] else 'NO'}")
    console.print(f"- BF16 refits: k3 KL = 0 exactly against the reference engine's forward on the same weights: "
                  f"{'yes' if checks['bf16_k3_kl_exactly_zero'] else 'NO'}")
    most = _megatron_max(rows)
    console.print(f"- Megatron's own forward against the engine's (\"Megatron k3\", BF16 arm): at most "
                  f"{most if most is not None else float('nan'):.2e}, bound {MEGATRON_K3_BOUND:.0e}: "
                  f"{'yes' if checks['megatron_k3_kl_within_bound'] else 'NO'}")
