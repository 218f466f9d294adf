"""Helpers of the multi-process tests: per-rank programs run by launch_world, and the
single-process references they are compared with (computed in the test process)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from adapters.memory.faults import RankFault
from adapters.reference.config import MICRO_MOE, hf_weight_shapes
from adapters.reference.trainer import ReferenceTrainer
from domain.quant.plan import QuantizationPlan
from domain.refit.topology import ParallelLayout, RefitWorld

MODEL = "micro-moe"
BUCKET_MB = 1 / 16  # 64 KiB: the micro model's refit takes several buckets
STEP_SCALE = 0.02
GENEROUS_S = 120.0  # the bound of every wait no fault is injected into
HANG_S = 30.0  # an injected hang: 20 times the timeout tests' bounds, so that no load reorders them


def plan(linear: str | None, moe: str | None) -> QuantizationPlan:
    return QuantizationPlan.from_presets(linear=linear, moe=moe)


def digest(weights: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """sha256 of every tensor's bytes: equal digests = bit-identical tensors."""
    return {
        n: hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for n, t in weights.items()
    }


@torch.no_grad()
def advance(trainer: ReferenceTrainer, step: int) -> None:
    """A training-like step whose result does not depend on the intra-op thread count (the
    processes run one thread, the test process more): noise scaled by each tensor's amax, an
    exact reduction (a standard deviation's summation order would depend on the threads)."""
    g = torch.Generator().manual_seed(1000 + step)
    for t in trainer.weights.values():
        noise = torch.randn(t.shape, generator=g)
        t.add_((STEP_SCALE * t.float().abs().amax() * noise).to(t.dtype))


def trainer_at(step: int, seed: int = 0) -> ReferenceTrainer:
    """The reference trainer after `step` training-like steps (step 0 = the seed's weights)."""
    t = ReferenceTrainer.from_seed(MICRO_MOE, seed)
    for i in range(1, step + 1):
        advance(t, i)
    return t


def single_process_digest(p: QuantizationPlan, step: int, seed: int = 0) -> dict[str, str]:
    """The engine's live weights after a single-process refit of the trainer at `step`."""
    from app.bootstrap import bootstrap

    services = bootstrap(overrides=[f"reference.model={MODEL}",
                                    f"rollout.checkpoint_engine.update_weights_bucket_megabytes={BUCKET_MB}"])
    svc = services.refit_service(plan=p, trainer=trainer_at(step, seed))
    svc.refit()
    return digest(dict(svc.engine.live_weights()))


def _service(world: RefitWorld, rank: int, comm: Any, p: QuantizationPlan, full: ReferenceTrainer | None,
             engine: Any, fault: RankFault | None, restore: str | None = None) -> Any:
    """This rank's service over its real ports, the fault's wrapper around the port it hits."""
    from adapters.distributed.sliced_trainer import SlicedTrainer
    from adapters.memory.faulty import RankPorts, wrap_rank
    from app.services.distributed_refit import DistributedRefitService
    from domain.refit.shard_map import ShardMap

    shapes = hf_weight_shapes(MICRO_MOE)
    trainer = SlicedTrainer(full, world.layout, rank) if full is not None else None
    ports = wrap_rank(fault, RankPorts(comm, trainer, engine), world.role(rank),
                      ShardMap.build(world.layout, shapes, p), hang_s=HANG_S)
    return DistributedRefitService(
        world, ports.comm, p, shapes, trainer=ports.trainer, engine=ports.engine,
        bucket_bytes=int(BUCKET_MB * 2**20), restore=restore,
    )


def _engine(p: QuantizationPlan, commit_mode: str) -> Any:
    from adapters.reference.engine import ReferenceEngine

    return ReferenceEngine(MICRO_MOE, p, commit_mode=commit_mode)


class _ScaleSpy:
    """The collectives, recording the NVFP4 global scale each split unit's amax all-reduce gives."""

    def __init__(self, comm: Any, scales: dict[str, list[float]]) -> None:
        self._comm, self.scales = comm, scales

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def tp_exchange(self, holders: Sequence[int], step: str, failed: bool, amax: torch.Tensor) -> Any:
        from domain.refit.shard_quant import global_scale_from_amax

        any_failed, reduced = self._comm.tp_exchange(holders, step, failed, amax)
        if step.startswith("export ") and not step.endswith("(quantized)") and float(reduced) > 0:
            unit = step.removeprefix("export ")
            self.scales.setdefault(unit, []).append(float(global_scale_from_amax(reduced, unit)))
        return any_failed, reduced


def layouts_rank(rank: int, cases: Sequence[tuple[dict[str, int], int, tuple[str | None, str | None]]]) -> list[Any]:
    """Bit-identity runs: for each (layout, engines, plan), two refits (step 0, then step 1).

    Returns, per case: every rank's outcomes, the trainer sources' NVFP4 global scales as they
    computed them, and the engines' digests after each refit.
    """
    from adapters.distributed.collectives import TorchDistCollectives

    out = []
    for layout_kwargs, engines, presets in cases:
        world = RefitWorld(ParallelLayout(**layout_kwargs), engines)
        comm = TorchDistCollectives(world, rank, step_timeout_s=60, phase_timeout_s=60,
                                    bucket_bytes=int(BUCKET_MB * 2**20))
        p = plan(*presets)
        full = trainer_at(0) if world.role(rank) == "trainer" else None
        engine = _engine(p, "transactional") if full is None else None
        scales: dict[str, list[float]] = {}
        spy = _ScaleSpy(comm, scales)
        svc = _service(world, rank, spy, p, full, engine, None)
        record: dict[str, Any] = {"outcomes": [], "digests": []}
        for step in (0, 1):
            if step and full is not None:
                advance(full, step)
            report = svc.refit()
            record["outcomes"].append(report.outcome.value)
            if engine is not None:
                record["digests"].append(digest(dict(engine.live_weights())))
        record["scales"] = scales
        out.append(record)
    return out


def faults_rank(rank: int, layout_kwargs: dict[str, int], engines: int, presets: tuple[str | None, str | None],
                commit_mode: str, faults: Sequence[RankFault]) -> list[dict[str, Any]]:
    """For each fault: refit 0 (step 0) succeeds, refit 1 (step 1) fails as scripted, refit 2
    (step 2) succeeds. Returns per fault: outcomes, error texts and the engine's digests."""
    from adapters.distributed.collectives import TorchDistCollectives
    from domain.errors import DistributedRefitFailed

    world = RefitWorld(ParallelLayout(**layout_kwargs), engines)
    comm = TorchDistCollectives(world, rank, step_timeout_s=60, phase_timeout_s=60, bucket_bytes=int(BUCKET_MB * 2**20))
    p = plan(*presets)
    inner = _engine(p, commit_mode) if world.role(rank) == "engine" else None
    out = []
    for fault in faults:
        full = trainer_at(0) if inner is None else None
        svc = _service(world, rank, comm, p, full, inner, fault)
        record: dict[str, Any] = {"outcomes": [], "errors": [], "digests": [], "stale": []}
        for step in (0, 1, 2):
            if step and full is not None:
                advance(full, step)
            try:
                record["outcomes"].append(svc.refit().outcome.value)
                record["errors"].append(None)
            except DistributedRefitFailed as err:
                record["outcomes"].append(err.report.outcome.value)
                record["errors"].append(str(err))
            if inner is not None:
                record["digests"].append(digest(dict(inner.live_weights())))
                record["stale"].append(inner.is_stale)
        out.append(record)
    return out


def hang_rank(rank: int, layout_kwargs: dict[str, int], engines: int, fault: RankFault,
              step_timeout_s: float, phase_timeout_s: float) -> dict[str, Any]:
    """One good refit, then one where `fault` hangs its rank. Returns what this rank raised."""
    import time

    from adapters.distributed.collectives import TorchDistCollectives

    world = RefitWorld(ParallelLayout(**layout_kwargs), engines)
    # the good refit under generous bounds (a loaded machine may take seconds per bucket); the
    # short bounds from the refit that hangs on
    comm = TorchDistCollectives(world, rank, step_timeout_s=GENEROUS_S, phase_timeout_s=GENEROUS_S,
                                bucket_bytes=int(BUCKET_MB * 2**20))
    p = plan("FP8_BLOCK", "NVFP4")
    inner = _engine(p, "transactional") if world.role(rank) == "engine" else None
    full = trainer_at(0) if inner is None else None
    svc = _service(world, rank, comm, p, full, inner, fault)
    svc.refit()
    comm.bound(step_timeout_s, phase_timeout_s)
    before = digest(dict(inner.live_weights())) if inner is not None else None
    t0 = time.monotonic()
    try:
        svc.refit()
        raised: dict[str, Any] = {"type": None}
    except Exception as err:
        raised = {"type": type(err).__name__, "text": str(err), "rank": getattr(err, "rank", None),
                  "step": getattr(err, "step", None), "report": getattr(err, "report", None) is not None}
    raised["seconds"] = time.monotonic() - t0
    if inner is not None:
        raised["kept"] = digest(dict(inner.live_weights())) == before
        raised["busy"] = False
        try:
            inner.log_probs(torch.zeros(1, 4, dtype=torch.int64))
        except Exception as err:
            raised["busy"] = type(err).__name__
    return raised
