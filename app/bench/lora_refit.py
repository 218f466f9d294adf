"""`refit bench refit --lora`: what a LoRA refit sends and costs, per `actor.lora.sync` mode.

For each embedded model and each format (BF16, FP8_BLOCK, MXFP8 on every quantized layer), a
trainer with a rank-R adapter on every attention and MLP projection (adapters.reference.lora)
takes training-like steps on the adapter only; each step is refitted into the embedded engine
(transactional). Rows, per mode:
- merged: the whole model, W + (alpha/r)·B·A, quantized by the plan. Bytes on the wire against the
  adapter's own bytes, the refit's seconds against a refit of the base alone (the merge's cost),
  and the mismatch (k3 KL, trainer's merged BF16 model against the engine) against the base's.
- adapter: the base refitted once, then the adapter alone each step (LoraSyncService). Bytes per
  step against the adapter's own bytes (the budget is 2x) and against a merged refit's, the
  step's seconds against a merged refit's, and the mismatch against the merged mode's.
"""

from __future__ import annotations

import logging
import statistics

import torch

from adapters.reference.config import preset
from adapters.reference.engine import ReferenceEngine
from adapters.reference.lora import LoraTrainer
from adapters.reference.trainer import ReferenceTrainer
from app.bench.report import BenchReport
from app.services.mismatch_probe import MismatchProbe, token_batch
from app.services.refit import RefitService
from domain.quant.plan import QuantizationPlan
from ports.rollout_engine import RolloutEngine
from ports.trainer_model import TrainerModel

MiB = 2**20
FORMATS = ("BF16", "FP8_BLOCK", "MXFP8")
STEPS = 3


def _plan(fmt: str) -> QuantizationPlan:
    return QuantizationPlan.bf16() if fmt == "BF16" else QuantizationPlan.from_presets(fmt, fmt)


def _k3(trainer: TrainerModel, engine: RolloutEngine, ids: torch.Tensor) -> float:
    return MismatchProbe(trainer, engine).probe(ids).metrics.k3_kl


def _merged_rows(report: BenchReport, name: str, base: ReferenceTrainer, fmt: str, rank: int) -> None:
    plan = _plan(fmt)
    lora = LoraTrainer.from_seed(base, r=rank)
    ids = token_batch(base.config.vocab_size, 4, 32, 10_000)
    merged = RefitService(lora, ReferenceEngine(base.config, plan), plan, bucket_bytes=64 * MiB)
    plain = RefitService(base, ReferenceEngine(base.config, plan), plan, bucket_bytes=64 * MiB)
    merged.refit()
    plain.refit()
    case = f"{name} {fmt} r={rank} merged"
    seconds: dict[str, list[float]] = {"merged": [], "base": []}
    for step in range(1, STEPS + 1):
        lora.perturb_(step, 0.02)
        r = merged.refit()
        seconds["merged"].append(r.timings["total"])
        seconds["base"].append(plain.refit().timings["total"])
    report.add(case, "bytes on the wire per refit", r.bytes_sent / MiB, "MiB", "the adapter's own bytes",
               lora.adapter.nbytes / MiB, preset=fmt)
    report.add(case, f"refit seconds (median of {STEPS})", statistics.median(seconds["merged"]), "s",
               "refit of the base alone", statistics.median(seconds["base"]), preset=fmt)
    report.add(case, "mismatch k3 KL (merged model)", _k3(lora, merged.engine, ids), "",
               "the base model's (no adapter)", _k3(base, plain.engine, ids), preset=fmt)


def _adapter_rows(report: BenchReport, name: str, base: ReferenceTrainer, fmt: str, rank: int) -> None:
    from app.services.lora_sync import LoraSyncService

    plan = _plan(fmt)
    lora = LoraTrainer.from_seed(base, r=rank)
    ids = token_batch(base.config.vocab_size, 4, 32, 10_000)
    engine = ReferenceEngine(base.config, plan)
    sync = LoraSyncService(lora, engine, RefitService(base, engine, plan, bucket_bytes=64 * MiB))
    merged = RefitService(lora, ReferenceEngine(base.config, plan), plan, bucket_bytes=64 * MiB)
    sync.sync()
    merged.refit()
    case = f"{name} {fmt} r={rank} adapter"
    seconds: dict[str, list[float]] = {"adapter": [], "merged": []}
    for step in range(1, STEPS + 1):
        lora.perturb_(step, 0.02)
        r = sync.sync()
        if not r.live:
            raise RuntimeError(f"{case}: an adapter step did not go live: {r.error}")
        seconds["adapter"].append(r.seconds)
        m = merged.refit()
        seconds["merged"].append(m.timings["total"])
    report.add(case, "bytes on the wire per step", r.bytes_sent / MiB, "MiB", "the adapter's own bytes",
               lora.adapter.nbytes / MiB, preset=fmt)
    report.add(case, "bytes on the wire per step vs merged", r.bytes_sent / MiB, "MiB", "a merged refit",
               m.bytes_sent / MiB, preset=fmt)
    report.add(case, f"step seconds (median of {STEPS})", statistics.median(seconds["adapter"]), "s",
               "a merged refit", statistics.median(seconds["merged"]), preset=fmt)
    report.add(case, "mismatch k3 KL (base + adapter)", _k3(lora, engine, ids), "",
               "the merged mode's", _k3(lora, merged.engine, ids), preset=fmt)


def run(quick: bool = False, rank: int = 16) -> BenchReport:
    """Run the suite.

    Args:
        quick: micro-moe only.
        rank: the adapter's rank.

    Returns:
        The BenchReport.
    """
    from app.logging import configure_logging

    configure_logging(level=logging.WARNING)
    models = ["micro-moe"] if quick else ["tiny-moe", "bench-moe"]
    report = BenchReport("refit-lora")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for model in models:
            base = ReferenceTrainer.from_seed(preset(model))
            report.notes.append(f"{model}: {base.config.num_parameters() / 1e6:.1f}M parameters, "
                                f"{base.num_bytes() / MiB:.1f} MiB of BF16 weights")
            for fmt in FORMATS:
                _merged_rows(report, model, base, fmt, rank)
                _adapter_rows(report, model, base, fmt, rank)
    finally:
        torch.set_num_threads(threads)
    report.notes.extend([
        f"an adapter of rank {rank} (lora_alpha {2 * rank}) on q/k/v/o and gate/up/down of every layer (routed "
        "experts have none); each step moves only the adapter",
        "merged: the whole quantized model every step; ratio = adapter bytes / bytes sent (how much more the merged "
        "mode sends), and refit seconds against a refit of the base alone (the cost of merging)",
        "adapter: the base once, then the adapter alone each step (the engine stages it under a fresh id and switches "
        "when it is held); ratio = bytes of the baseline / bytes sent, and the merged refit's seconds / the step's",
        "k3 KL: the trainer's BF16 merged model against the engine, on 4 x 32 tokens; the baseline is the same "
        "format's mismatch without an adapter (merged rows) or the merged mode's (adapter rows)",
        "the embedded engine merges the served adapter into its dequantized weights (BF16: exactly the merged "
        "model); the engines apply it beside the base with their own LoRA kernels",
    ])
    return report
