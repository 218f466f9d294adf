"""`refit bench sharded`: refits from a real Megatron-Core trainer sharded over processes (tp, pp,
ep) against the tp = pp = ep = 1 export of the same model, measured in the same run.

Each layout runs in a world of its own (its trainer ranks and one reference engine rank, gloo on
127.0.0.1, one intra-op thread each) with the same model, plan (FP8_BLOCK dense layers, NVFP4
experts) and bucket size. After one refit that learns the stream layout, each world times a few
refits; every trainer rank resets its peak resident memory (VmHWM) just before them. Reported per
layout:

- throughput: the model's BF16 bytes over the median refit time of the slowest trainer rank
  (its export, the exchanges with its tensor-parallel peers, the stream), against the tp=1 refit;
- peak memory per trainer rank: the largest rise of VmHWM over the rank's resident memory before
  the refits (what the export adds to the trainer: gathered shards, quantized pieces, buckets),
  against the tp=1 rank's; and the shards each rank holds (its share of the model).

The full run uses `bench-moe` (~247M parameters) with 64 MiB buckets; `--quick` `tiny-moe`
with 4 MiB buckets. Megatron-Core is optional: without it the suite is skipped.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import attrs

from app.bench.memory import process_kib, reset_peak_rss
from app.bench.report import BenchReport
from domain.quant.plan import QuantizationPlan
from domain.refit.topology import ParallelLayout, RefitWorld

QUICK = ("tiny-moe", 4.0, 3, [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2)])
FULL = ("bench-moe", 64.0, 5, [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 2), (2, 2, 1), (2, 2, 2)])


@attrs.frozen
class _Run:
    model: str
    bucket_mb: float
    repeats: int
    layout: ParallelLayout


def _services(run: _Run) -> Any:
    from app.bootstrap import bootstrap
    from app.config_sections import (
        ActorConfig,
        CheckpointEngineConfig,
        MegatronConfig,
        ReferenceConfig,
        RefitConfig,
        RolloutConfig,
    )

    lay = run.layout
    megatron = MegatronConfig(tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
                              expert_model_parallel_size=lay.ep, expert_tensor_parallel_size=lay.etp)
    return bootstrap(RefitConfig(
        reference=ReferenceConfig(model=run.model), actor=ActorConfig(strategy="megatron", megatron=megatron),
        rollout=RolloutConfig(checkpoint_engine=CheckpointEngineConfig(update_weights_bucket_megabytes=run.bucket_mb)),
    ))




def bench_rank(rank: int, run: _Run) -> dict[str, Any]:
    """One process of a layout's world: a warm-up refit, then `repeats` timed ones."""
    services = _services(run)
    world = services.world.refit_world(engines=1)
    plan = QuantizationPlan.from_presets(linear="FP8_BLOCK", moe="NVFP4")
    with services.embedded.megatron_demo_kit().parallel(world.layout, rank) as model:
        svc = services.world.distributed_refit(world, rank, plan=plan, model=model, step_timeout_s=300, phase_timeout_s=900)
        svc.refit()  # learns the stream layout
        base = reset_peak_rss()
        seconds = []
        for _ in range(run.repeats):
            t0 = time.perf_counter()
            report = svc.refit()
            seconds.append(time.perf_counter() - t0)
        peak = process_kib("VmHWM")
    return {"role": world.role(rank).value, "seconds": seconds, "extra_kib": max(peak - base, 0),
            "source_mb": report.source_bytes / 2**20, "sent_mb": report.bytes_sent / 2**20}


def run(quick: bool = False) -> BenchReport:
    from app.bootstrap import bootstrap
    from app.composition.tables import TRAINERS
    from app.config_sections import ReferenceConfig, RefitConfig

    TRAINERS["megatron"].require("refit bench sharded", "megatron")
    model, bucket_mb, repeats, layouts = QUICK if quick else FULL
    services = bootstrap(RefitConfig(reference=ReferenceConfig(model=model)))
    config = services.embedded.reference_config()
    model_mb = config.num_parameters() * 2 / 2**20  # BF16
    report = BenchReport("sharded")
    measured: dict[str, dict[str, float]] = {}
    for tp, pp, ep in layouts:
        layout = ParallelLayout(tp, pp, ep)
        run_ = _Run(model, bucket_mb, repeats, layout)
        world = RefitWorld(layout, 1)
        results = services.world.launch_world(bench_rank, world.size, (run_,), timeout_s=600 if quick else 3600,
                                        start_method="forkserver")
        bad = [f"rank {r.rank}: {r.error}\n{r.traceback or ''}{r.output[-1500:]}" for r in results if not r.ok]
        if bad:
            raise RuntimeError("refit bench sharded: a rank failed:\n" + "\n".join(bad))
        trainers = [r.value for r in results if r.value["role"] == "trainer"]
        slowest = statistics.median(max(t["seconds"][i] for t in trainers) for i in range(repeats))
        measured[layout.describe()] = {
            "mb_s": model_mb / slowest, "peak_mib": max(t["extra_kib"] for t in trainers) / 1024,
            "shard_mib": max(t["source_mb"] for t in trainers), "ranks": layout.size,
        }
    base = measured[ParallelLayout().describe()]
    case = f"{model} ({config.num_parameters() / 1e6:.0f}M params), FP8_BLOCK + NVFP4, {bucket_mb:g} MiB buckets"
    for name, m in measured.items():
        row_case = f"{case}, {name} ({m['ranks']:.0f} trainer ranks)"
        report.add(row_case, "sharded refit throughput, slowest trainer rank", m["mb_s"], "MB/s",
                   "tp=1 export", base["mb_s"], figure="throughput")
        report.add(row_case, "peak extra memory per trainer rank", m["peak_mib"], "MiB",
                   "tp=1 export", base["peak_mib"], figure="memory")
        report.add(row_case, "largest shard per trainer rank", m["shard_mib"], "MiB", "tp=1: the whole model", base["shard_mib"])
    report.notes += [
        f"the model's BF16 bytes: {model_mb:.1f} MiB; every refit is byte-identical to the tp=1 one "
        "(tests/integration/test_megatron_sharded_refit.py)",
        "peak extra memory: VmHWM reset before the timed refits, minus the resident memory then; a TP-split unit's "
        "source holds every rank's piece of that one unit (quantized where shards cover whole blocks, BF16 "
        "otherwise), besides its buckets",
        "2 cores shared by every process of a world: the ranks of one layout run at once, so more ranks per "
        "core lower each one's throughput; the ratios say what the layout costs on this machine, not on GPUs",
    ]
    return report
