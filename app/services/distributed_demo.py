"""`refit demo --procs N`: the demo's refits with trainer and engine ranks in N processes.

The processes (2 to 4) join one gloo world on 127.0.0.1: with 2, one trainer rank and one engine;
with 3, two trainer ranks (expert parallel for the MoE model, tensor parallel for the dense one)
and one engine; with 4, those two trainer ranks and two engine replicas. Every step perturbs the
trainer's weights (each trainer rank does the same step on its copy) and runs one distributed
refit; then the test process runs the same steps as a single-process refit and compares every
engine's live weights with it, bit for bit. `--inject-fault` (with `--fault-rank`) makes one rank
fail at one step of the `--fault-step` refit: every rank then reports the same failure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from typing import Any

import attrs
import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

STEP_TIMEOUT_S, PHASE_TIMEOUT_S = 10.0, 30.0


def add_procs_arguments(p: argparse.ArgumentParser) -> None:
    """The `--procs` options of `refit demo`."""
    p.add_argument("--procs", type=int, default=None, metavar="N",
                   help="run trainer and engine ranks in N processes (2-4) over gloo on 127.0.0.1")
    p.add_argument("--fault-rank", type=int, default=None, metavar="R",
                   help="with --procs: the rank --inject-fault hits (default: the last engine; rank 0 for export:K)")


@attrs.frozen
class _Run:
    world: Any
    plan: Any
    model: str
    seed: int
    steps: int
    step_scale: float
    commit_mode: str
    bucket_megabytes: float
    fault: Any


def _weights_digest(weights: Any) -> str:
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def demo_rank(rank: int, run: _Run) -> list[dict[str, Any]]:
    """One process of the demo world: every step's refit on this rank."""
    from app.bootstrap import build_distributed_refit
    from domain.errors import CollectiveTimeout, DistributedRefitFailed, PeerLost

    svc = build_distributed_refit(
        run.world, rank, plan=run.plan, model=run.model, seed=run.seed, commit_mode=run.commit_mode,
        bucket_megabytes=run.bucket_megabytes, fault=run.fault, step_timeout_s=STEP_TIMEOUT_S,
        phase_timeout_s=PHASE_TIMEOUT_S, hang_s=STEP_TIMEOUT_S + 5,
    )
    records = []
    for step in range(run.steps + 1):
        if step and svc.trainer is not None:
            getattr(svc.trainer, "full").perturb_(run.seed * 1_000 + step, run.step_scale)  # noqa: B009
        try:
            report, error = svc.refit(), None
        except (DistributedRefitFailed, CollectiveTimeout, PeerLost) as err:
            report, error = getattr(err, "report"), str(err)  # noqa: B009
        records.append({
            "step": step, "rank": rank, "role": svc.role, "outcome": report.outcome.value, "error": error,
            "ms": report.timings["total"] * 1e3, "mb": report.bytes_sent / 2**20, "buckets": report.buckets,
            "digest": _weights_digest(dict(svc.engine.live_weights())) if svc.engine is not None else None,
            "stale": bool(svc.engine.is_stale) if svc.engine is not None else None,
        })
        if svc.broken is not None:
            break  # a timeout broke the world: no more refits
    return records


def _references(run: _Run) -> list[str]:
    """The single-process refit's engine weights at every step (one intra-op thread, as the ranks
    run: a perturbation's reductions depend on the thread count)."""
    from app.bootstrap import build_refit_service

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        svc = build_refit_service(plan=run.plan, model=run.model, seed=run.seed, commit_mode=run.commit_mode,
                                  bucket_megabytes=run.bucket_megabytes)
        out = []
        for step in range(run.steps + 1):
            if step:
                getattr(svc.trainer, "perturb_")(run.seed * 1_000 + step, run.step_scale)  # noqa: B009
            svc.refit()
            out.append(_weights_digest(dict(svc.engine.live_weights())))
        return out
    finally:
        torch.set_num_threads(threads)


def _verdicts(records: list[dict[str, Any]], refs: list[str]) -> None:
    """Per engine record: its weights against the single-process refit of the same step, or of
    the last step whose refit went live (after a failed refit)."""
    last_live: dict[int, int] = {}
    for r in sorted(records, key=lambda r: (r["rank"], r["step"])):
        if r["digest"] is None:
            r["weights"] = "-"
            continue
        if r["outcome"] == "live":
            last_live[r["rank"]] = r["step"]
        if r["stale"]:
            r["weights"] = "stale (refuses to serve)"
            continue
        k = last_live.get(r["rank"])
        want = refs[k] if k is not None else None
        if r["outcome"] == "live":
            r["weights"] = "= single-process" if r["digest"] == want else "DIFFERENT"
        else:
            r["weights"] = f"kept step {k}, bit-identical" if r["digest"] == want else "CHANGED"


def run_procs(args: argparse.Namespace) -> int:
    """`refit demo --procs N`: run, compare with the single-process refit, print."""
    from adapters.distributed.launch import launch_world
    from adapters.memory.faults import RankFault
    from adapters.reference.config import preset
    from app.cli.demo import settings_from_args
    from app.services.refit import describe_plan
    from domain.errors import ConfigError, RefitError
    from domain.refit.sharding import RefitWorld

    try:
        settings = settings_from_args(args)
        world = RefitWorld.for_procs(args.procs, moe=preset(settings.model).is_moe)
        fault = None
        if settings.inject_fault:
            text = settings.inject_fault
            rank = args.fault_rank if args.fault_rank is not None else (0 if text.startswith("export") else world.size - 1)
            fault = RankFault.parse(text, rank, refit=settings.fault_step)
            world.role(rank)
    except RefitError:
        raise
    except ValueError as err:
        raise ConfigError("refit demo --procs", str(err)) from None
    run = _Run(world, settings.plan, settings.model, settings.seed, settings.steps, settings.step_scale,
               settings.commit_mode, settings.bucket_megabytes, fault)
    results = launch_world(demo_rank, world.size, (run,), timeout_s=120 + 20 * settings.steps)
    crashed = [r for r in results if not r.ok]
    if crashed:
        text = "\n".join(f"rank {r.rank}: {r.error}\n{r.output[-1500:]}" for r in crashed)
        sys.stderr.write(f"refit demo --procs: a rank did not finish:\n{text}\n")
        return 1
    records = [rec for r in results for rec in r.value]
    refs = _references(run)
    _verdicts(records, refs)
    identical = all(r["weights"] in ("-", "= single-process") or r["weights"].endswith("bit-identical") for r in records)
    header = (
        f"refit demo --procs {args.procs}: {settings.model}, plan {describe_plan(settings.plan)}, trainer "
        f"{world.layout.describe()} on ranks {list(world.trainer_ranks)}, engines on ranks {list(world.engine_ranks)}, "
        f"gloo on 127.0.0.1" + (f", fault {fault} on rank {fault.rank} at step {fault.refit}" if fault else "")
    )
    if args.json:
        fired = None if fault is None else any(r["error"] for r in records if r["step"] == fault.refit)
        payload = {"header": header, "world": {"layout": world.layout.describe(), "engines": world.engines},
                   "records": records, "engines_match_single_process": identical, "fault_fired": fired}
        sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
        return 0
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
    if fault is not None and not any(r["error"] for r in records if r["step"] == fault.refit):
        console.print(f"- the injected fault {fault} never fired (fewer buckets than K, or a step past --steps?)")
    console.print(f"- every engine bit-identical to the single-process refit: {'yes' if identical else 'NO'}")
    return 0 if identical else 1
