"""`refit bench refit`: end-to-end refit throughput and peak extra memory of the embedded engine.

The full run refits the `bench-moe` reference model (247M parameters, ~0.5 GB of BF16 weights);
`--quick` uses `tiny-moe`. In the same run, the naive baseline refits the same weights per
tensor, unbucketed: each tensor is quantized with compressed-tensors' own functions
(calculate_qparams + the format's compressor) and handed to `load_state_dict` of a module that
holds the checkpoint-format tensors.

Rows (ratios against the same-run baseline, or against the memory bound):
- refit throughput, GB of BF16 source weights per second, per plan and commit mode;
- peak extra memory: the engine's staging bytes plus the sender's one bucket, against the bound
  (transactional: the staged quantized tensors; per-layer: one bucket plus one commit group);
- every tensor allocated during a refit (TensorBytesTracker), for the default plan;
- a bucket-size sweep;
- mismatch (k3 KL) per preset on the tiny model, to read next to the throughput;
- the peak host memory of a transactional refit into each engine whose loader backs up what it
  overwrites (the engine plugin's `backup`), against its bound, the bytes the refit overwrites
  (app/bench/loader_backup.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import torch

from adapters.reference.config import preset
from adapters.reference.engine import ReferenceEngine
from adapters.reference.layout import EngineLayout
from adapters.reference.trainer import ReferenceTrainer
from app.bench.report import BenchReport
from app.services.refit import RefitService
from app.services.transaction import Ownership
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import quantize_stream
from domain.refit.report import RefitReport
from domain.refit.session import CommitMode

MiB = 2**20
BASELINE = "naive per-tensor compressed-tensors + load_state_dict"


def _plans() -> dict[str, QuantizationPlan]:
    return {"BF16": QuantizationPlan.bf16(), "FP8_BLOCK/NVFP4": QuantizationPlan.from_presets("FP8_BLOCK", "NVFP4")}


# --- the naive baseline ----------------------------------------------------------------------


def _naive_module(named: Iterator[tuple[str, torch.Tensor]]) -> torch.nn.Module:
    """A module tree holding one buffer per checkpoint tensor, by its dotted name."""
    root = torch.nn.Module()
    for name, t in named:
        *path, leaf = name.split(".")
        node = root
        for part in path:
            if not hasattr(node, part):
                node.add_module(part, torch.nn.Module())
            node = getattr(node, part)
        node.register_buffer(leaf, torch.zeros(t.shape, dtype=t.dtype))
    return root


def _naive_refit(trainer: ReferenceTrainer, plan: QuantizationPlan, module: torch.nn.Module) -> None:
    from app.bench.codecs import _ct_path  # compressed-tensors' quantize path, shared with the codecs bench

    for name, w in trainer.named_weights():
        d = plan.decide(name, tuple(w.shape))
        if d.is_quantized:
            prefix = name.removesuffix(".weight")
            quantize = _ct_path(d.format, w)
            if quantize is None:
                raise ModuleNotFoundError("refit bench refit's baseline needs compressed-tensors",
                                          name="compressed_tensors")
            compressed: dict[str, torch.Tensor] = quantize()  # type: ignore[assignment]
            state = {f"{prefix}.{k}": v for k, v in compressed.items()}
        else:
            state = {name: w}
        module.load_state_dict(state, strict=False)


def _baseline_seconds(trainer: ReferenceTrainer, plan: QuantizationPlan) -> float:
    module = _naive_module(quantize_stream(plan, trainer.named_weights()))
    small = ReferenceTrainer.from_seed(preset("micro-moe"))
    _naive_refit(small, plan, _naive_module(quantize_stream(plan, small.named_weights())))  # warm up
    t0 = time.perf_counter()
    _naive_refit(trainer, plan, module)
    return time.perf_counter() - t0


# --- ours ------------------------------------------------------------------------------------


def _service(trainer: ReferenceTrainer, plan: QuantizationPlan, mode: CommitMode, bucket_mb: float) -> RefitService:
    engine = ReferenceEngine(trainer.config, plan, commit_mode=mode)
    return RefitService(trainer, engine, plan, bucket_bytes=int(bucket_mb * MiB))


def _bound(layout: EngineLayout, mode: CommitMode, bucket_bytes: int) -> int:
    groups: dict[str, int] = {}
    for m in layout.modules.values():
        size = sum(dtype.itemsize * torch.Size(shape).numel() for shape, dtype in m.staging().values())
        groups[m.group] = groups.get(m.group, 0) + size
    staged = sum(groups.values()) if mode is CommitMode.TRANSACTIONAL else max(groups.values())
    return staged + bucket_bytes


def _steady_refit(svc: RefitService) -> RefitReport:
    svc.refit()  # the first refit pays one-time costs (page faults, kernel warm-up)
    return svc.refit()


def _tracked_peak(svc: RefitService) -> int | None:
    try:
        from app.bench.memory import TensorBytesTracker
    except ImportError:
        return None
    with TensorBytesTracker() as tracker:
        svc.refit()
    return tracker.peak_bytes


def _throughput_rows(report: BenchReport, trainer: ReferenceTrainer, model: str, bucket_mb: float) -> None:
    source_gb = trainer.num_bytes() / 1e9
    for label, plan in _plans().items():
        base_gbps = source_gb / _baseline_seconds(trainer, plan)
        for mode in CommitMode:
            svc = _service(trainer, plan, mode, bucket_mb)
            r = _steady_refit(svc)
            case = f"{model} {label} {mode.value} bucket {bucket_mb:g} MiB"
            report.add(case, "refit throughput", r.throughput_gbps, "GB/s", BASELINE, base_gbps,
                       figure="throughput", preset=label)
            bound = _bound(svc.engine.layout, mode, svc.bucket_bytes)  # type: ignore[attr-defined]
            # By reference (the default in one process) there is no bucket buffer: the engine keeps
            # views of the exported tensors, which the tracked row below counts.
            buffers = 0 if svc.ownership is Ownership.BY_REFERENCE else min(svc.bucket_bytes, r.bytes_sent)
            _memory_row(report, case, "peak extra memory (engine staging + bucket buffers)",
                        r.peak_staging_bytes + buffers, bound, label)
            tracked = _tracked_peak(svc)
            if tracked is not None:
                _memory_row(report, case, "every tensor allocated during the refit", tracked, bound, label)


def _memory_row(report: BenchReport, case: str, metric: str, nbytes: int, bound: int, label: str) -> None:
    """A memory row against its bound. Below a thousandth of the bound (a BF16 refit by reference
    allocates nothing; a quantized one stages only its few global scales) a ratio would only
    measure how small the remainder is, so the row has none."""
    if nbytes * 1000 < bound:
        report.add(case, metric, nbytes / MiB, "MiB")
        return
    report.add(case, metric, nbytes / MiB, "MiB", "bound", bound / MiB, figure="memory", preset=label)


def _sweep_rows(report: BenchReport, trainer: ReferenceTrainer, model: str, sizes: tuple[float, ...]) -> None:
    label, plan = "FP8_BLOCK/NVFP4", _plans()["FP8_BLOCK/NVFP4"]
    base_gbps = trainer.num_bytes() / 1e9 / _baseline_seconds(trainer, plan)
    for mb in sizes:
        for mode in CommitMode:
            svc = _service(trainer, plan, mode, mb)
            r = _steady_refit(svc)
            case = f"{model} {label} {mode.value} bucket {mb:g} MiB"
            report.add(case, "refit throughput (bucket sweep)", r.throughput_gbps, "GB/s", BASELINE, base_gbps,
                       figure="bucket", preset=label, x=mb)


def _mismatch_rows(report: BenchReport, model: str) -> None:
    from app.services.mismatch_probe import MismatchProbe, response_mask, token_batch

    cfg = preset(model)
    trainer = ReferenceTrainer.from_seed(cfg)
    ids, mask = token_batch(cfg.vocab_size, 4, 64, seed=1), response_mask(4, 64, 16)
    for name in ("FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4"):
        plan = QuantizationPlan.from_presets(name, name)
        svc = _service(trainer, plan, CommitMode.TRANSACTIONAL, 4)
        svc.refit()
        m = MismatchProbe(trainer, svc.engine).probe(ids, mask).metrics
        report.add(f"{model} {name}", "k3 KL", m.k3_kl, "nats", figure="mismatch", preset=name)
        report.add(f"{model} {name}", "mean |log-prob diff|", m.mean_abs_logp_diff, "nats", figure="mismatch", preset=name)


def run(quick: bool = False) -> BenchReport:
    """Run the suite.

    Args:
        quick: the tiny model and small buckets (well under a minute) instead of the 247M model.

    Returns:
        The BenchReport.
    """
    model = "tiny-moe" if quick else "bench-moe"
    bucket_mb = 1.0 if quick else 64.0
    sizes = (0.25, 1.0, 4.0) if quick else (16.0, 64.0, 256.0)
    from app.logging import configure_logging

    configure_logging(level=logging.WARNING)  # stderr; the canonical refit lines would flood the table
    threads = torch.get_num_threads()
    # One intra-op thread for both paths: on a shared machine, more threads make many small ops
    # wait on descheduled workers and the figures become noise; the ratios are what we compare.
    torch.set_num_threads(1)
    try:
        return _run(model, bucket_mb, sizes, quick)
    finally:
        torch.set_num_threads(threads)


def _run(model: str, bucket_mb: float, sizes: tuple[float, ...], quick: bool) -> BenchReport:
    report = BenchReport("refit")
    trainer = ReferenceTrainer.from_seed(preset(model))
    params = trainer.config.num_parameters()
    report.notes.extend([
        f"{model}: {params / 1e6:.0f}M parameters, {trainer.num_bytes() / 1e9:.3f} GB of BF16 weights; "
        "throughput = source GB / end-to-end refit seconds (export, quantize, pack, load, finalize, check), "
        "second refit of each engine",
        "buckets by reference (RefitService's default in one process): nothing is packed and the engine keeps "
        "views until it commits; a BF16 refit allocates nothing, a quantized one holds the codec outputs "
        "until their commit group is committed (per-layer) or the refit is (transactional)",
    ])
    _throughput_rows(report, trainer, model, bucket_mb)
    _sweep_rows(report, trainer, model, sizes)
    _mismatch_rows(report, "micro-moe" if quick else "tiny-moe")
    from app.bench import loader_backup

    loader_backup.rows(report, model, bucket_mb)
    report.notes.append("target: at least 3x the baseline's throughput; memory rows: ratio >= 1 means within the bound")
    report.notes.append(
        "the baseline holds one tensor at a time and has no transactional guarantee: a failure mid-way "
        "leaves its module half-updated"
    )
    return report
