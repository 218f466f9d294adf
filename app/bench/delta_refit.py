"""`refit bench refit --delta`: what a delta refit (backend layout_delta) sends and costs.

For each model (the embedded presets, and with `--model DIR` a checkpoint's shapes, e.g. the
Qwen3-0.6B fixture of `python -m app.bench.fixtures`) and each format (BF16, FP8_BLOCK, MXFP8,
NVFP4 on every quantized layer), a full refit is followed by Adam-like steps (every element moves
by +-lr in FP32 from the BF16 weights, then back to BF16; one step at lr 1e-6, then one at 1e-5),
each sent as a delta refit into the embedded engine (transactional). Rows:
- bytes on the wire against a full refit of the same format and against a full BF16 refit;
- the delta refit's seconds against the full refit's, and its diff (trainer) and patch (engine)
  seconds, which the total includes;
- the extra memory: both sides' host copies of the checkpoint-format tensors.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import torch

from adapters.reference.engine import ReferenceEngine
from adapters.reference.trainer import ReferenceTrainer, adam_like_step_
from app.bench.report import BenchReport
from app.services.refit import RefitService
from domain.quant.plan import QuantizationPlan
from domain.refit.delta_sync import DeltaSender

MiB = 2**20
FORMATS = ("BF16", "FP8_BLOCK", "MXFP8", "NVFP4")
LRS = (1e-6, 1e-5)


def _plan(fmt: str) -> QuantizationPlan:
    if fmt == "BF16":
        return QuantizationPlan.bf16()
    return QuantizationPlan.from_presets(fmt, fmt)


def _trainer(model: str | Path) -> tuple[str, ReferenceTrainer]:
    if isinstance(model, Path):
        from app.bootstrap import bootstrap

        trainer = bootstrap(overrides=[f"model.path={model}"]).trainer_model()
        return model.name, trainer  # type: ignore[return-value]
    from adapters.reference.config import preset

    return model, ReferenceTrainer.from_seed(preset(model))


def _rows(report: BenchReport, name: str, trainer: ReferenceTrainer, fmt: str, bucket_bytes: int) -> None:
    plan = _plan(fmt)
    svc = RefitService(trainer, ReferenceEngine(trainer.config, plan), plan, bucket_bytes=bucket_bytes,
                       delta=DeltaSender(full_every=1000))
    full = svc.refit()
    bf16_bytes = full.source_bytes  # a full BF16 refit sends the trainer's BF16 weights
    for lr in LRS:
        adam_like_step_(trainer.weights.values(), seed=int(1 / lr), lr=lr)
        r = svc.refit()
        d = r.delta
        if d is None or d.mode != "delta":
            raise RuntimeError(f"{name} {fmt}: the refit after a step was not a delta refit ({d})")
        case = f"{name} {fmt} lr {lr:g}"
        report.add(case, "bytes on the wire", d.wire_bytes / MiB, "MiB", f"full {fmt} refit", d.full_bytes / MiB,
                   preset=fmt, x=lr)
        if fmt != "BF16":
            report.add(case, "bytes on the wire", d.wire_bytes / MiB, "MiB", "full BF16 refit", bf16_bytes / MiB,
                       preset=fmt, x=lr)
        report.add(case, "refit seconds", r.timings["total"], "s", f"full {fmt} refit", full.timings["total"],
                   preset=fmt)
        report.add(case, "diff seconds (trainer: diff, hash, keep)", d.diff_seconds, "s")
        report.add(case, "patch seconds (engine: patch, hash, keep)", d.patch_seconds, "s")
        for phase in ("export", "quantize", "pack", "load", "finalize"):
            report.add(case, f"{phase} seconds", r.timings.get(phase, 0.0), "s")
        report.add(case, "extra memory (trainer + engine copies)",
                   (d.trainer_host_bytes + d.engine_host_bytes) / MiB, "MiB")
        report.add(case, "tensors sent as delta records", float(d.tensors_delta), "tensors")
        report.add(case, "tensors sent whole", float(d.tensors_whole), "tensors")
        del r


def run(quick: bool = False, model_dir: str | None = None) -> BenchReport:
    """Run the suite.

    Args:
        quick: micro-moe only.
        model_dir: a Qwen3 / Qwen3-MoE checkpoint directory whose shapes are also measured.

    Returns:
        The BenchReport.
    """
    from app.logging import configure_logging

    configure_logging(level=logging.WARNING)
    models: list[str | Path] = ["micro-moe"] if quick else ["tiny-moe", "bench-moe"]
    if model_dir is not None:
        models.append(Path(model_dir))
    report = BenchReport("refit-delta")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for model in models:
            name, trainer = _trainer(model)
            report.notes.append(f"{name}: {trainer.config.num_parameters() / 1e6:.0f}M parameters, "
                                f"{trainer.num_bytes() / 1e9:.3f} GB of BF16 weights")
            for fmt in FORMATS:
                _rows(report, name, trainer, fmt, 64 * MiB)
                gc.collect()  # the format's engine and both copies, before the next format's
            del trainer
    finally:
        torch.set_num_threads(threads)
    report.notes.extend([
        "each format: one full refit, then an Adam-like step at lr 1e-6 and one at 1e-5 (each element +-lr in "
        "FP32 from the BF16 weights, then BF16), each sent as a delta refit; ratio = full bytes (or seconds) / "
        "delta's",
        "a full BF16 refit sends the trainer's BF16 weights (the report's source bytes)",
        "the refit seconds include the diff and the patch (SHA-256 of every kept tensor on each side) and run on "
        "one thread in one process: no link; add bytes / link speed for a real transfer (docs/refit.md)",
    ])
    return report
