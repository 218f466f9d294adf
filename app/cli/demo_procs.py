"""`refit demo procs N`: the demo's refits with trainer and engine ranks in N processes.

The processes (2 to 4) join one gloo world on 127.0.0.1: with 2, one trainer rank and one engine;
with 3, two trainer ranks (expert parallel for the MoE model, tensor parallel for the dense one)
and one engine; with 4, those two trainer ranks and two engine replicas. Every step perturbs the
trainer's weights (each trainer rank does the same step on its copy) and runs one distributed
refit; then this process runs the same steps as a single-process refit and compares every
engine's live weights with it, bit for bit (app.services.distributed_demo.judge).
With `--engine vllm`, each engine rank starts a vLLM server of its own (rl-refit's, dummy
weights, refusing to serve until its first refit) and records what it serves after every refit
(prompt log-probs, greedy tokens, every parameter's digest); this process then starts vLLM cold
from the single-process export of each step and compares the two, bit for bit, as `refit demo
vllm` does (app.services.engine_demo).
`--inject-fault` (with `--fault-rank`) makes one rank fail at one step of the `--fault-step`
refit: every rank then reports the same failure. The exit status is the same in text and JSON:
0 when every engine holds what it should, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pickle
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from app.bootstrap import Services, bootstrap
from app.cli.demo_settings import (
    REAL_ENGINE_PHASE_TIMEOUT_S,
    REAL_ENGINE_STEP_TIMEOUT_S,
    demo_services,
    raise_typed_failure,
    real_engine_settings,
    starting_servers,
)
from app.services.demo import DemoSettings
from app.services.demo_config import engine_config
from app.services.distributed_demo import demo_world, judge, single_process, weights_digest
from app.services.distributed_refit import DistributedRefitService
from app.services.engine_demo import ColdStartComparer, EngineDemoSettings, EngineStep, ServedBatch, inspected
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
    engine: EngineDemoSettings | None = None  # a real engine's demo settings (None: the embedded engine)


def _services(settings: DemoSettings, engine: EngineDemoSettings | None) -> Services:
    """The composition root's services of every rank and of this process: the embedded engine's,
    or a real engine's (the embedded model as the trainer either way)."""
    if engine is None:
        return demo_services(settings)
    return bootstrap(engine_config(engine, settings.bucket_megabytes))


def demo_rank(rank: int, run: _Run) -> list[dict[str, Any]]:
    """One process of the demo world: every step's refit on this rank."""
    s = run.settings
    services = _services(s, run.engine)
    # A trainer rank's full model, which its shards are views of (whatever wraps them: a fault's
    # port). Engine ranks hold one too when the post-refit probe is on (rollout.verify.enabled):
    # they take the same training-like steps, so its forward is the probe's reference.
    engine_rank = run.world.role(rank) is Role.ENGINE
    full = services.trainer_model() if not engine_rank or services.config.rollout.verify.enabled else None
    step_s, phase_s = (STEP_TIMEOUT_S, PHASE_TIMEOUT_S) if run.engine is None else (
        REAL_ENGINE_STEP_TIMEOUT_S, REAL_ENGINE_PHASE_TIMEOUT_S)
    svc = services.world.distributed_refit(
        run.world, rank, plan=s.plan, fault=run.fault, step_timeout_s=step_s,
        phase_timeout_s=phase_s, hang_s=step_s + 5, reference=full if engine_rank else None,
    )
    try:
        return _steps(rank, run, svc, full, services)
    finally:
        if svc.engine is not None and run.engine is not None:
            inspected(svc.engine).close()  # stops the server this rank started


def _steps(rank: int, run: _Run, svc: DistributedRefitService, full: Any,
           services: Services) -> list[dict[str, Any]]:
    """This rank's refit at every step, and on an engine rank what its engine holds or serves after each."""
    s, engine = run.settings, svc.engine
    observer = None
    if run.engine is not None and engine is not None:  # what a real engine serves: read after each refit
        observer = ServedBatch.of(services.embedded.reference_config().vocab_size, run.engine)
    records = []
    for step in range(s.steps + 1):
        if step and full is not None:
            full.perturb_(s.seed * 1_000 + step, s.step_scale)
        report: RefitReport | None
        try:
            report, error = svc.refit(), None
        except DistributedRefitFailed as err:
            report, error = err.report, str(err)
        except (CollectiveTimeout, PeerLost) as err:
            report, error = err.report, str(err)
        record: dict[str, Any] = {
            "step": step, "rank": rank, "role": svc.role.value, "outcome": report.outcome.value if report else "-",
            "error": error, "ms": report.timings["total"] * 1e3 if report else 0.0,
            "mb": report.bytes_sent / 2**20 if report else 0.0, "buckets": report.buckets if report else 0,
            "digest": None, "stale": bool(engine.is_stale) if engine is not None else None,
        }
        if engine is not None and observer is not None:
            seen = observer.observe(inspected(engine))
            record["digest"] = seen if isinstance(seen, str) else seen.fingerprint()
            if report is not None and report.ok:  # this process compares it with a cold start (_cold_starts)
                # pickled here, by value: a tensor put on the world's result queue as it is would travel
                # as a shared-memory handle, which ends with this process
                record["served"], record["report"] = pickle.dumps(seen), report
        elif engine is not None:
            record["digest"] = weights_digest(dict(engine.live_weights()))
        records.append(record)
        if svc.broken is not None:
            break  # a timeout broke the world: no more refits
    return records


def _references(settings: DemoSettings) -> list[str]:
    """The single-process refit's engine weights at every step (one intra-op thread, as the ranks
    run: a perturbation's reductions depend on the thread count)."""
    with _one_thread():
        svc = demo_services(settings).refit_service(plan=settings.plan)
        out = []
        for step in range(settings.steps + 1):
            if step:
                svc.trainer.perturb_(settings.seed * 1_000 + step, settings.step_scale)  # type: ignore[attr-defined]
            svc.refit()
            out.append(weights_digest(dict(svc.engine.live_weights())))
        return out


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


def _cold_starts(engine: EngineDemoSettings, services: Services,
                 records: list[dict[str, Any]]) -> dict[tuple[int, int], EngineStep]:
    """Every engine record's verdict against a cold start of the single-process export of its step
    (one cold start per distinct export; none for a step no engine went live at)."""
    trainer: Any = services.trainer_model()
    served = {(r["rank"], r["step"]): r for r in records if "served" in r}
    verdicts: dict[tuple[int, int], EngineStep] = {}
    with tempfile.TemporaryDirectory(prefix="rl-refit-demo-procs-") as tmp:
        comparer = ColdStartComparer(services, trainer.config.vocab_size, engine, Path(tmp))
        for step in range(engine.steps + 1):
            if step:
                with _one_thread():  # as the ranks perturbed theirs
                    trainer.perturb_(engine.seed * 1_000 + step, engine.step_scale)
            for (rank, at), r in sorted(served.items()):
                if at == step:
                    seen = pickle.loads(r.pop("served"))  # pickled by this demo's own ranks
                    verdicts[(rank, step)] = comparer.against(seen, trainer, r.pop("report"), step)
    return verdicts


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """One intra-op thread, as the ranks run: a perturbation's reductions depend on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_procs(args: argparse.Namespace, settings: DemoSettings) -> int:
    """`refit demo procs N`: run, compare with the single-process refit (or, on a real engine,
    with cold starts of its export), print."""
    engine = real_engine_settings(args, settings)
    if engine is not None:
        settings = attrs.evolve(settings, plan=engine.plan, model=engine.model, steps=engine.steps)
    services = _services(settings, engine)
    world = demo_world(args.procs, moe=services.embedded.reference_config().is_moe)
    fault = _fault(services, settings, world, args.fault_rank)
    run = _Run(settings, world, fault, engine)
    timeout = 120 + 20 * settings.steps if engine is None else 900 + 120 * settings.steps
    if engine is not None and not args.json:
        sys.stderr.write(starting_servers(engine.engine, world.engines))
    results = services.world.launch_world(demo_rank, world.size, (run,), timeout_s=timeout)
    raise_typed_failure(results)
    crashed = [r for r in results if not r.ok]
    if crashed:
        text = "\n".join(f"rank {r.rank}: {r.error}\n{r.output[-1500:]}" for r in crashed)
        sys.stderr.write(f"refit demo procs: a rank did not finish:\n{text}\n")
        return 1
    records = [rec for r in results for rec in r.value]
    if engine is None:
        good = judge(records, single_process(_references(settings)))
    else:
        verdicts = _cold_starts(engine, services, records)
        for (rank, step), verdict in verdicts.items():
            record = next(r for r in records if r["rank"] == rank and r["step"] == step)
            record.update(verdict.comparison())
        good = judge(records, lambda r: verdicts[(r["rank"], r["step"])].equals_cold_start is True, "cold start")
    engines = "" if engine is None else f" (a {engine.engine} server each)"
    header = (
        f"refit demo procs {args.procs}: {settings.model}, plan {describe_plan(settings.plan)}, trainer "
        f"{world.layout.describe()} on ranks {list(world.trainer_ranks)}, engines on ranks {list(world.engine_ranks)}"
        f"{engines}, gloo on 127.0.0.1" + (f", fault {fault} on rank {fault.rank} at step {fault.refit}" if fault else "")
    )
    fired = None if fault is None else any(r["error"] for r in records if r["step"] == fault.refit)
    if args.json:
        payload = {"header": header, "world": {"layout": world.layout.describe(), "engines": world.engines},
                   "engine": "reference" if engine is None else engine.engine, "records": records,
                   "engines_match_single_process" if engine is None else "engines_match_cold_starts": good,
                   "fault_fired": fired}
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
    for r in records:
        if r.get("equals_cold_start") is False:
            console.print(f"- step {r['step']}, rank {r['rank']}: differs from the cold start: log-probs equal "
                          f"{r['logprobs_equal']}, tokens equal {r['tokens_equal']}, weights differing "
                          f"{r['differing_weights']}")
    unreadable = sorted({n for r in records for n in r.get("unreadable", ())})
    if unreadable:
        console.print(f"- {len(unreadable)} weights were not compared byte for byte: the engine keeps them packed "
                      "outside their (empty) parameter; the log-probs and greedy tokens check them")
    if engine is not None and settings.steps:
        console.print("- a trainer rank's ms from step 1 on includes its wait for the engine ranks, which read what "
                      "they serve after each refit")
    reference = "the single-process refit" if engine is None else "a cold start of the single-process export"
    console.print(f"- every engine holds what it should (bit-identical to {reference}, kept, or "
                  f"stale and refusing to serve): {'yes' if good else 'NO'}")
    return 0 if good else 1
