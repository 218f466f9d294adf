"""`refit demo procs N`: the demo's refits with trainer and engine ranks in N processes.

The processes (2 to 4) join one gloo world on 127.0.0.1: with 2, one trainer rank and one engine;
with 3, two trainer ranks (expert parallel for the MoE model, tensor parallel for the dense one)
and one engine; with 4, those two trainer ranks and two engine replicas. Every step perturbs the
trainer's weights (each trainer rank does the same step on its copy) and runs one distributed
refit; then this process runs the same steps as a single-process refit and compares every
engine's live weights with it, bit for bit (app.services.distributed_demo.judge).
`--inject-fault` (with `--fault-rank`) makes one rank fail at one step of the `--fault-step`
refit: every rank then reports the same failure. The exit status is the same in text and JSON:
0 when every engine holds what it should, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import attrs
import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from app.bootstrap import Services
from app.cli.demo_settings import demo_services, raise_typed_failure
from app.services.demo import DemoSettings
from app.services.distributed_demo import demo_world, judge, weights_digest
from app.services.transaction import describe_plan
from domain.errors import CollectiveTimeout, ConfigError, DistributedRefitFailed, PeerLost
from domain.refit.report import RefitReport
from domain.refit.status import Role
from domain.refit.topology import RefitWorld

STEP_TIMEOUT_S, PHASE_TIMEOUT_S = 10.0, 30.0


@attrs.frozen
class _Run:
    settings: DemoSettings
    world: RefitWorld
    fault: Any


def demo_rank(rank: int, run: _Run) -> list[dict[str, Any]]:
    """One process of the demo world: every step's refit on this rank."""
    s = run.settings
    services = demo_services(s)
    # A trainer rank's full model, which its shards are views of (whatever wraps them: a fault's
    # port). Engine ranks hold one too when the post-refit probe is on (rollout.verify.enabled):
    # they take the same training-like steps, so its forward is the probe's reference.
    engine_rank = run.world.role(rank) is Role.ENGINE
    full = services.trainer_model() if not engine_rank or services.config.rollout.verify.enabled else None
    svc = services.world.distributed_refit(
        run.world, rank, plan=s.plan, fault=run.fault, step_timeout_s=STEP_TIMEOUT_S,
        phase_timeout_s=PHASE_TIMEOUT_S, hang_s=STEP_TIMEOUT_S + 5, reference=full if engine_rank else None,
    )
    records = []
    for step in range(s.steps + 1):
        if step and full is not None:
            full.perturb_(s.seed * 1_000 + step, s.step_scale)  # type: ignore[attr-defined]
        report: RefitReport | None
        try:
            report, error = svc.refit(), None
        except DistributedRefitFailed as err:
            report, error = err.report, str(err)
        except (CollectiveTimeout, PeerLost) as err:
            report, error = err.report, str(err)
        records.append({
            "step": step, "rank": rank, "role": svc.role.value, "outcome": report.outcome.value if report else "-",
            "error": error, "ms": report.timings["total"] * 1e3 if report else 0.0,
            "mb": report.bytes_sent / 2**20 if report else 0.0, "buckets": report.buckets if report else 0,
            "digest": weights_digest(dict(svc.engine.live_weights())) if svc.engine is not None else None,
            "stale": bool(svc.engine.is_stale) if svc.engine is not None else None,
        })
        if svc.broken is not None:
            break  # a timeout broke the world: no more refits
    return records


def _references(settings: DemoSettings) -> list[str]:
    """The single-process refit's engine weights at every step (one intra-op thread, as the ranks
    run: a perturbation's reductions depend on the thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        svc = demo_services(settings).refit_service(plan=settings.plan)
        out = []
        for step in range(settings.steps + 1):
            if step:
                svc.trainer.perturb_(settings.seed * 1_000 + step, settings.step_scale)  # type: ignore[attr-defined]
            svc.refit()
            out.append(weights_digest(dict(svc.engine.live_weights())))
        return out
    finally:
        torch.set_num_threads(threads)


def _fault(services: Services, settings: DemoSettings, world: RefitWorld, fault_rank: int | None) -> Any:
    if not settings.inject_fault:
        if fault_rank is not None:
            raise ConfigError("--fault-rank", "needs --inject-fault (the fault it places)")
        return None
    text = settings.inject_fault
    rank = fault_rank if fault_rank is not None else (0 if text.startswith("export") else world.size - 1)
    if not 0 <= rank < world.size:
        raise ConfigError("--fault-rank", f"rank {rank} is not in the world of {world.size} processes (0..{world.size - 1})")
    return services.world.rank_fault(text, rank, settings.fault_step)


def run_procs(args: argparse.Namespace, settings: DemoSettings) -> int:
    """`refit demo procs N`: run, compare with the single-process refit, print."""
    services = demo_services(settings)
    world = demo_world(args.procs, moe=services.embedded.reference_config().is_moe)
    fault = _fault(services, settings, world, args.fault_rank)
    results = services.world.launch_world(demo_rank, world.size, (_Run(settings, world, fault),),
                                    timeout_s=120 + 20 * settings.steps)
    raise_typed_failure(results)
    crashed = [r for r in results if not r.ok]
    if crashed:
        text = "\n".join(f"rank {r.rank}: {r.error}\n{r.output[-1500:]}" for r in crashed)
        sys.stderr.write(f"refit demo procs: a rank did not finish:\n{text}\n")
        return 1
    records = [rec for r in results for rec in r.value]
    good = judge(records, _references(settings))
    header = (
        f"refit demo procs {args.procs}: {settings.model}, plan {describe_plan(settings.plan)}, trainer "
        f"{world.layout.describe()} on ranks {list(world.trainer_ranks)}, engines on ranks {list(world.engine_ranks)}, "
        f"gloo on 127.0.0.1" + (f", fault {fault} on rank {fault.rank} at step {fault.refit}" if fault else "")
    )
    fired = None if fault is None else any(r["error"] for r in records if r["step"] == fault.refit)
    if args.json:
        payload = {"header": header, "world": {"layout": world.layout.describe(), "engines": world.engines},
                   "records": records, "engines_match_single_process": good, "fault_fired": fired}
        sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
        return 0 if good else 1
    console = Console(width=max(Console().width, 120))
    console.print(header)
    table = Table(title="one row per step and rank (step 0 = initial sync)")
    for col in ("step", "rank", "role", "outcome", "ms", "MB sent/recv", "buckets", "engine weights"):
        table.add_column(col, justify="right" if col in ("step", "rank", "ms", "MB sent/recv", "buckets") else "left")
    for r in sorted(records, key=lambda r: (r["step"], r["rank"])):
        table.add_row(str(r["step"]), str(r["rank"]), r["role"], r["outcome"], f"{r['ms']:.0f}", f"{r['mb']:.2f}",
                      str(r["buckets"]), r["weights"])
    console.print(table)
    for text in dict.fromkeys(r["error"] for r in records if r["error"]):
        console.print(f"- failure: {escape(text)}")
    if fired is False:
        console.print(f"- the injected fault {fault} never fired (fewer buckets than K, or a step past --steps?)")
    console.print("- every engine holds what it should (bit-identical to the single-process refit, kept, or "
                  f"stale and refusing to serve): {'yes' if good else 'NO'}")
    return 0 if good else 1
