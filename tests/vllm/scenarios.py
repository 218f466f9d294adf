"""Real-engine scenarios, run in a process of their own by tests/vllm/test_real_engine.py:
`python -m tests.vllm.scenarios '{"scenario": ..., "deployment": ..., "linear": ..., "moe": ..., "model": ...}'`.

Each builds the engine through the composition root exactly as `refit demo vllm` does
(with tests.vllm.extensions.TestExtension as the worker extension), runs its refits, compares
each live one with a cold start of the same export, and prints one JSON line (the last line of
stdout; vLLM logs to stderr).

- matrix: refit, perturb and refit, back to the first weights and refit; no tensor rebound.
  With `tensor_parallel_size` the engine runs that many workers; with `replicas` one refit updates
  that many engines, and each is compared with the cold start.
- faults: a fault at a bucket (trainer side), at finalize, and in the receiver (worker side),
  each followed by a full refit that must recover.
- delta: layout_delta refits over Adam-like steps, each compared with a full refit of the same
  weights on the same engine (every parameter's digest), and a corrupted base copy on the worker.
- distributed: the matrix's refits, each through a refit world (app.services.distributed_refit):
  trainer ranks holding the embedded trainer's shares as Megatron's grid `layout` ([tp, pp, ep,
  etp]) places them, and one engine rank holding this engine; every rank a thread of this process
  over in-memory collectives.
- shapes: the fault table of tests/integration/test_refit_shapes.py (begin, a bucket, finalize,
  the storage check, the probe) with each restore (stale, replay): the failed refit's outcome
  and engine state, what the engine serves afterwards, and the recovery.
- guards: the KV-cache scales poisoned then reset by a refit; a silently corrupted refit
  caught by the post-refit probe; the BF16 expert redo switched off (what vLLM alone does).
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from adapters.memory.faults import FaultScript
from adapters.memory.faulty import ScriptedFaultyEngine
from adapters.vllm.protocol import WorkerRpc
from app.bootstrap import bootstrap
from app.services.demo_config import engine_config, with_engine_args
from app.services.distributed_refit import DistributedRefitService
from app.services.engine_demo import ColdStartComparer, EngineDemoSettings, EngineStep
from app.services.refit import RefitService
from app.services.verification import PostRefitProbe, TrainerReference, probe_batch
from domain.errors import RefitError, RefitFailed
from domain.quant.plan import QuantizationPlan
from tests.vllm.cold_host import with_cold_host
from tests.vllm.extensions import Corrupt, CorruptDeltaCopy, DisableRedo, FailReceiver, PoisonKv

EXTENSION = "tests.vllm.extensions.TestExtension"


def _preset(name: str | None) -> str | None:
    return None if name in (None, "BF16") else name


def _step(record: EngineStep, **extra: Any) -> dict[str, Any]:
    rep = record.report
    return {
        "step": record.label, "outcome": rep.outcome.value, "ok": rep.ok, "error": rep.error,
        "serving": record.serving, "equals_cold_start": record.equals_cold_start,
        "logprobs_equal": record.logprobs_equal, "tokens_equal": record.tokens_equal,
        "weights_equal": record.weights_equal, "differing": list(record.differing_weights),
        "not_compared": list(record.not_compared),
        "storage_ok": rep.storage.ok, "storage_changed": list(rep.storage.changed),
        "kv_scales_reset": rep.kv_scales_reset, "kv_scales": record.kv_scales,
        "parameters_written": rep.parameters_written, "unwritten": list(rep.unwritten),
        "probe": rep.probe.to_dict() if rep.probe is not None else None, **extra,
    }


def _refit(svc: RefitService | DistributedRefitService) -> Any:
    try:
        return svc.refit()
    except RefitFailed as err:
        return err.report


def run(spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    plan = QuantizationPlan.from_presets(_preset(spec.get("linear")), _preset(spec.get("moe")),
                                         linear_activation=spec.get("linear_activation"),
                                         moe_activation=spec.get("moe_activation"))
    settings = EngineDemoSettings(deployment=spec["deployment"], plan=plan, model=spec.get("model", "micro-moe"))
    # start_timeout_s: two engines starting at once on 2 loaded cores
    shape: dict[str, Any] = {"worker_extension_cls": EXTENSION}
    if spec.get("tensor_parallel_size"):  # workers in processes of their own, bound to the cores given
        shape["tensor_parallel_size"] = spec["tensor_parallel_size"]
    config = with_engine_args(engine_config(settings, 0.25), start_timeout_s=900, **shape)
    if spec.get("replicas"):  # data-parallel rollout: one refit updates every replica
        config = attrs.evolve(config, rollout=attrs.evolve(config.rollout, replicas=spec["replicas"]))
    if spec.get("transport"):  # disaggregated: how the buckets reach the workers (default: shm)
        kwargs = config.rollout.engine_kwargs
        kwargs = attrs.evolve(kwargs, vllm=attrs.evolve(kwargs.vllm, transport=spec["transport"]))
        config = attrs.evolve(config, rollout=attrs.evolve(config.rollout, engine_kwargs=kwargs))
    services = bootstrap(config)
    try:
        engine: Any = services.rollout_engine()
    except Exception as err:  # the engine did not start: the test decides whether that may be so
        return {"spec": spec, "not_started": _start_failure(err)}
    trainer: Any = services.trainer_model()
    if spec.get("lora"):  # actor.lora.sync merged: the base with a trainable adapter, merged at export
        from adapters.reference.lora import LoraTrainer

        trainer = LoraTrainer.from_seed(trainer, r=spec["lora"], seed=1)
    svc = services.refit_service(engine=engine, trainer=trainer)
    cache = Path(spec["cold_cache"]) if spec.get("cold_cache") else None
    comparer = ColdStartComparer(with_cold_host(services), trainer.config.vocab_size, settings, workdir, cache)
    replicas: list[Any] = list(getattr(engine, "replicas", [engine]))
    scenario = spec["scenario"]
    # how a refit runs: this process's RefitService, or a world of trainer ranks and this engine's rank
    refit, ranks = (_world_refit(services, engine, spec["layout"]) if scenario == "distributed"
                    else (lambda: _refit(svc), 1))

    # ExtensionWorkers (colocated) or AttachedWorkers (the server rl-refit started): both answer protocol requests
    workers: WorkerRpc = replicas[0].workers
    out: dict[str, Any] = {"spec": spec, "refused_before_first_refit": comparer.refuses(engine), "steps": [],
                           "replicas": len(replicas), "ranks": ranks,
                           "workers": [w if isinstance(w := getattr(r.workers, "workers", 1), int) else 1
                                       for r in replicas],
                           "digest_names": sorted(replicas[0].digests())[:2]}
    steps = out["steps"]
    fingerprint = engine.storage_fingerprint()

    def refit_and_compare(label: str, service: RefitService | None = None, **extra: Any) -> None:
        report = _refit(service) if service is not None else refit()
        for i, replica in enumerate(replicas):  # every replica against the same cold start
            record = comparer.compare(replica, trainer, report, 0)
            steps.append(_step(record, name=label if len(replicas) == 1 else f"{label} replica {i}",
                               **_served(replica, comparer), **extra))

    try:
        refit_and_compare("first")
        start = trainer.snapshot()
        if scenario in ("matrix", "distributed"):
            trainer.perturb_(1, 0.02)
            refit_and_compare("second")
            trainer.restore_(start)
            refit_and_compare("back")
        elif scenario == "faults":
            for point in ("bucket:1", "finalize"):
                trainer.perturb_(len(steps), 0.02)
                faulty = services.refit_service(engine=ScriptedFaultyEngine(engine, FaultScript.parse(point)),
                                                trainer=trainer)
                refit_and_compare(f"fault {point}", faulty)
                refit_and_compare(f"after {point}")
            trainer.perturb_(len(steps), 0.02)
            workers.call(FailReceiver(1))
            refit_and_compare("fault receiver")
            refit_and_compare("after receiver")
        elif scenario == "shapes":
            out["shapes"] = _shapes(services, engine, trainer, comparer)
            refit_and_compare("after every fault")
        elif scenario == "guards":
            poisoned = workers.call(PoisonKv(7.0)).count
            before = engine.kv_scales()
            trainer.perturb_(1, 0.02)
            refit_and_compare("after kv poison", poisoned_layers=poisoned, scales_before=before)
            probe = PostRefitProbe(TrainerReference(trainer),
                                   probe_batch(trainer.config.vocab_size, 2, 16, 0))
            probed = attrs.evolve(svc, probe=probe, reports=[])
            refit_and_compare("probe, clean", probed)
            workers.call(Corrupt("lm_head"))  # doubles every logit
            refit_and_compare("probe, corrupted", probed)
            workers.call(Corrupt("\x00"))  # matches no name: stop corrupting
            refit_and_compare("probe, clean again", probed)
            if plan.moe.name == "BF16" and trainer.config.num_experts:
                workers.call(DisableRedo())
                trainer.perturb_(len(steps), 0.02)
                refit_and_compare("without the expert redo")
        elif scenario == "delta":
            _delta_steps(svc, engine, trainer, workers, steps)
        else:
            raise ValueError(f"unknown scenario {scenario!r}")
        out["rebound"] = fingerprint.differences(engine.storage_fingerprint())
        out["transport"] = getattr(replicas[0].workers, "transport_used", None)  # the one the buckets took
    finally:
        engine.close()
    return out


def _world_refit(services: Any, engine: Any, layout: list[int]) -> tuple[Callable[[], Any], int]:
    """A refit through a world of trainer ranks (the embedded trainer's shares, as Megatron's grid
    `layout` = [tp, pp, ep, etp] places them) and one engine rank holding `engine`, each rank a
    thread over in-memory collectives: what the refit returns is the engine rank's report; and the
    world's size."""
    from adapters.memory.collectives import InMemoryWorld
    from domain.refit.status import Role
    from domain.refit.topology import ParallelLayout, RefitWorld

    world = RefitWorld(ParallelLayout(*layout), 1)
    shared = InMemoryWorld(world, step_timeout_s=600.0, phase_timeout_s=600.0)
    ranks = [services.world.distributed_refit(world, r, comm=shared.collectives(r),
                                              engine=engine if world.role(r) is Role.ENGINE else None)
             for r in range(world.size)]
    engine_rank = next(r for r in range(world.size) if world.role(r) is Role.ENGINE)

    def refit() -> Any:
        reports: dict[int, Any] = {}

        def run_rank(rank: int) -> None:
            try:
                reports[rank] = _refit(ranks[rank])
            except BaseException as err:  # raised again below, in this thread
                reports[rank] = err

        threads = [threading.Thread(target=run_rank, args=(r,), daemon=True) for r in range(world.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for report in reports.values():
            if isinstance(report, BaseException):
                raise report
        return reports[engine_rank]

    return refit, world.size


def _served(engine: Any, comparer: ColdStartComparer) -> dict[str, Any]:
    """What the engine serves now: a digest of its parameters' digests, and its prompt log-probs
    (None while it refuses to serve)."""
    import hashlib

    if comparer.refuses(engine):
        return {"digests": None, "served_log_probs": None}
    digests = json.dumps(sorted(engine.digests().items())).encode()
    return {"digests": hashlib.sha256(digests).hexdigest(), "served_log_probs": engine.log_probs(comparer.ids)[0].tolist()}


def _delta_steps(svc: RefitService, engine: Any, trainer: Any, workers: WorkerRpc, steps: list[dict[str, Any]]) -> None:
    """Adam-like steps, each sent as a delta refit, then as a full refit of the same weights: the
    engine's parameter and buffer digests after both must be equal. Then a corrupted base copy on
    the worker: the engine refuses the delta (it goes stale, never mixed), the same refit is sent
    whole and equals the full one, and the next refit is a delta again."""
    from adapters.reference.trainer import AdamLikeSteps
    from adapters.vllm.worker import activation_scale_kind
    from domain.quant.stream import quantize_stream
    from domain.refit.delta_sync import DeltaSender

    delta_svc = attrs.evolve(svc, delta=DeltaSender(full_every=100), reports=[])
    adam = AdamLikeSteps.of(trainer.weights.values())
    # As in the cold-start comparison: activation scales of a kind the refit carries no tensor of
    # are placeholders no load writes (vLLM's weight-only NVFP4 experts), so they are not compared.
    carried = {activation_scale_kind(n) for n, _ in quantize_stream(svc.plan, trainer.named_weights())}

    def digests() -> dict[str, str]:
        return {n: d for n, d in engine.digests().items()
                if (kind := activation_scale_kind(n)) is None or kind in carried}

    def both(label: str, **extra: Any) -> None:
        rep = _refit(delta_svc)
        after_delta = digests() if rep.ok else {}
        full = _refit(svc)
        after_full = digests()
        steps.append({"name": label, "ok": rep.ok and full.ok, "outcome": rep.outcome.value, "error": rep.error,
                      "full_error": full.error, "mode": rep.delta.mode, "why_full": rep.delta.why_full,
                      "ratio": rep.delta.ratio, "equal_to_full": after_delta == after_full,
                      "differing": sorted(n for n in after_full if after_delta.get(n) != after_full[n])[:5],
                      **extra})

    both("delta base")  # the receiver's first refit: full
    for i, lr in enumerate((1e-4, 1e-3)):
        adam.step_(seed=i + 1, lr=lr)
        both(f"delta lr={lr}")
    corrupted = workers.call(CorruptDeltaCopy()).name
    adam.step_(seed=9, lr=1e-4)
    refused = len(delta_svc.reports)
    both("corrupted copy", corrupted=corrupted)  # the refused delta goes whole within the same refit
    attempt = delta_svc.reports[refused]
    steps[-1].update(attempts=len(delta_svc.reports) - refused, refused_mode=attempt.delta.mode,
                     refused_outcome=attempt.outcome.value, refused_error=attempt.error)
    adam.step_(seed=10, lr=1e-4)
    both("after corrupted copy")


SHAPE_POINTS = ("begin", "bucket:1", "finalize", "storage", "probe")


def _shapes(services: Any, engine: Any, trainer: Any, comparer: Any) -> list[dict[str, Any]]:
    """Per restore and fault point: a refit, a training-like step, a refit failing at the point,
    then a refit that must recover; through one service each (its replay copy is its own)."""
    from tests.integration.test_refit_shapes import FlakyReference

    out = []
    for restore in ("stale", "replay"):
        for point in SHAPE_POINTS:
            wrapped = engine if point == "probe" else ScriptedFaultyEngine(engine, attrs.evolve(FaultScript.parse(point),
                                                                                              after=1))
            reference = FlakyReference(TrainerReference(trainer), fail_at=1 if point == "probe" else -1)
            probe = PostRefitProbe(reference, probe_batch(trainer.config.vocab_size, 2, 16, 0))  # type: ignore[arg-type]
            svc = attrs.evolve(services.refit_service(engine=wrapped, trainer=trainer, restore=restore), probe=probe)
            first = _refit(svc)
            before = engine.digests()
            trainer.perturb_(len(out) + 1, 0.02)
            failed = _refit(svc)
            after = engine.digests()
            refuses = comparer.refuses(engine)
            again = _refit(svc)
            out.append({"restore": restore, "point": point, "first_ok": first.ok, "outcome": failed.outcome.value,
                        "engine_state": failed.engine_state, "error": failed.error,
                        "serves_previous": after == before and not refuses, "refuses": refuses,
                        "recovered": again.ok, "recovered_error": again.error})
    return out


def _start_failure(err: BaseException) -> str:
    """Why the engine did not start, in one line: vLLM's own reason where it gave one."""
    from adapters.vllm.launcher import root_cause

    text = f"{type(err).__name__}: {err}"
    return (root_cause(text) or text.splitlines()[0])[:2000]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(args[0])
    with tempfile.TemporaryDirectory(prefix="rl-refit-scenario-") as tmp:
        try:
            result = run(spec, Path(tmp))
        except RefitError as err:
            result = {"spec": spec, "error": f"{type(err).__name__}: {err}"}
    sys.stdout.write("\n" + json.dumps(result, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
