"""`refit bench engine`: refit time into a real engine against the engine's own ways in, all in
one engine (started once), for the same weights.

The engine is one whose plugin names its baselines (adapters.engine_plugin.EngineBaselines; for
one engine's adapters/<engine>/bench.py), started as `refit demo ENGINE` starts it (the embedded model, dummy
weights) with the baselines' worker extension, colocated (the engine in this process, buckets by
reference) or disaggregated (a server of the engine rl-refit starts, buckets through the
shared-memory ring, or over a side gloo group). After a first refit (the engine goes live), one
untimed try of each baseline and a warm-up round, `repeat` rounds measure, in turns (the order
reversed every other round, so that a load change on a shared machine hits every path alike),
wall-clock seconds in the trainer's process of:

- `rl-refit refit`: RefitService.refit() through the composition root: quantize, bucket,
  stream, the engine's reload, the expert redo, the KV-scale reset, the storage check;
- `write checkpoint`: the same quantized tensors written as one safetensors file (what the disk
  baseline needs on disk first; page cache, no fsync);
- the engine's reload from disk (`reload`): the workers reload that file the engine's own way
  (for example a worker's `reload_weights(weights_path=DIR, is_checkpoint_format=True)`);
- the engine's reload of the same buckets (`layerwise`): the same buckets through the same
  transport, into the engine's own reload and nothing else: the floor of its loading and
  processing, without rl-refit's worker-side work (expert redo, written-parameter audit, tied
  head, KV scales) or its trainer-side checks;
- `made, sent and dropped`: the same buckets, quantized and packed by the trainer and through the
  same transport, dropped by the worker: the floor of the trainer's side and the transport;
- per-bucket `load_weights`: the same buckets through the same transport, each handed straight
  to the model's loaders with no reload around them and no processing, into checkpoint-format
  tensors set up beside the engine's own (untimed, before each such call, and put back after
  it). A timing floor only: such writes need not reach what the engine computes with.

And the engine's start (in this process with the engine already imported; disaggregated, the
server's start until it serves, the engine's import included), for scale.

Rows: rl-refit's median refit time against each baseline's median (ratio = baseline / ours,
above 1 = the refit is faster). Notes: the refit's phases; whether the engine held the same bytes
after rl-refit's refit as after the engine's reload of the same weights (the reload compared starts
from an engine holding other weights, a refit of perturbed trainer weights, so that a reload
that changed nothing cannot pass); whether a load_weights round left the engine's bytes as they
were; a baseline that failed, and why; and what each figure includes.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from adapters.engine_plugin import EngineBaselines
from adapters.plugins import BENCH_ENGINES, plugin_for
from app.bench.child import python_has
from app.bench.report import BenchReport
from domain.refit.storage import DigestComparison

if TYPE_CHECKING:
    from app.config_sections import RefitConfig

DEPLOYMENTS = ("auto", "colocated", "disaggregated")

REFIT = "rl-refit refit"
RECEIVE = "the same buckets made, sent and dropped (trainer side + transport floor)"
RESTART = "engine start (a restart instead of a refit)"
COPY = "copy_ of the same bytes in this process (the memory bound)"
BF16_REFIT = "rl-refit refit of the same model in BF16 (same run)"
QUANTIZED_BOUND = 1.5  # a quantized refit takes at most this many times the same model's BF16 refit


@attrs.frozen
class EngineBenchSettings:
    """What `refit bench engine` measures.

    Attributes:
        deployment: colocated, disaggregated, or auto (colocated when the engine imports here).
        model: the embedded model preset.
        preset: the rollout plan, linear and MoE alike: one the engine's CPU build serves (its
            baselines' `presets`).
        repeat: measured rounds of each path (the median is reported).
        bucket_mb: bucket size, MiB.
        trainer_threads: torch threads of the trainer's process while it measures; None: on a
            machine without CUDA, disaggregated, half the cores (see `trainer_threads_for`).
        engine: rollout.name of an engine whose plugin names its baselines (default: the first).
    """

    deployment: str = "auto"
    model: str = "micro-moe"
    preset: str = "FP8_BLOCK"
    repeat: int = 3
    bucket_mb: float = 1.0
    trainer_threads: int | None = None
    engine: str = BENCH_ENGINES[0]

    def __attrs_post_init__(self) -> None:
        if self.engine not in BENCH_ENGINES:
            raise ValueError(f"engine must be one of {', '.join(BENCH_ENGINES)}, got {self.engine!r}")
        if self.deployment not in DEPLOYMENTS:
            raise ValueError(f"deployment must be one of {', '.join(DEPLOYMENTS)}, got {self.deployment!r}")
        presets = self.baselines.presets
        if self.preset.upper() not in presets:
            raise ValueError(f"preset must be one of {', '.join(presets)} (what {self.baselines.name}'s CPU build "
                             f"serves), got {self.preset!r}")
        if self.repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {self.repeat}")
        if self.trainer_threads is not None and self.trainer_threads < 1:
            raise ValueError(f"trainer_threads must be >= 1 (or None), got {self.trainer_threads}")

    @property
    def baselines(self) -> EngineBaselines:
        """The engine's own ways in (its plugin's)."""
        bench = plugin_for(self.engine).bench
        assert bench is not None, "BENCH_ENGINES holds the engines with baselines"
        return bench()

    def trainer_threads_for(self, deployment: str, cpu_count: int, cuda: bool) -> int | None:
        """The trainer's torch threads for a deployment, None: leave them as they are.

        Disaggregated on CPU, the engine's server shares the trainer's cores, and a server that
        busy-polls its message queues after every call (the baselines' `threads` note,
        docs/benchmarks.md) leaves an OpenMP team spanning every core waiting at each barrier for
        a descheduled thread (on 2 cores, quantizing right after an RPC took 30 times as long).
        So by default the trainer gets half the cores and the server the rest. Colocated, the
        engine sets this process's threads itself.

        Args:
            deployment: colocated or disaggregated.
            cpu_count: the machine's cores.
            cuda: CUDA is available (quantization runs on the GPU).
        """
        if self.trainer_threads is not None:
            return self.trainer_threads
        if deployment == "disaggregated" and not cuda:
            return max(1, cpu_count // 2)
        return None

    @classmethod
    def defaults(cls, quick: bool) -> EngineBenchSettings:
        """`--quick`: micro-moe, 3 rounds; the full run: tiny-moe, 7 rounds, 4 MiB buckets."""
        return cls(repeat=3) if quick else cls(model="tiny-moe", repeat=7, bucket_mb=4.0)


@attrs.frozen
class EngineTimings:
    """What one engine measured (seconds, wall clock in the trainer's process).

    Attributes:
        deployment: colocated or disaggregated.
        start: the engine's start.
        refit: rl-refit's refits, one per round.
        write: writing the checkpoint, one per round.
        reload: the engine's reload from disk, one per round (empty: it failed, see reload_error).
        load_weights: the per-bucket load_weights rounds (empty: it failed, see load_weights_error).
        layerwise: the rounds of the engine's reload of the same buckets (empty: it failed, see
            layerwise_error).
        receive: the rounds of the same buckets received and dropped (empty: not measured).
        transport: disaggregated, how the buckets reached the engine's server ("shm": the
            shared-memory ring; "gloo": the side group); None colocated.
        source_bytes: the trainer's BF16 weights.
        sent_bytes: the bytes one refit sends (quantized).
        buckets: buckets per refit.
        trainer_threads: the trainer's torch threads while it measured (None: as the engine or
            the process set them).
        phases: rl-refit's refit per phase (export, quantize, pack, load, finalize, verify), the
            median over the measured rounds.
        same_bytes: the engine held the same bytes after rl-refit's refit as after its own reload
            (None: not compared).
        moved: before the compared reload the engine held other weights (a refit of perturbed
            trainer weights), so that a reload that changed nothing could not pass as the same
            bytes (None: the trainer cannot be perturbed, the reload started from the same weights).
        differing: the tensors that differed (at most 10).
        unreadable: the parameters no byte comparison here could read, so none of them counts as
            equal: the engine keeps them packed outside their (emptied) tensor (docs/engines.md);
            `same_bytes`, `moved`, `layerwise_same` and `put_back` compare the rest.
        reload_error: why the engine's reload from disk could not be measured.
        load_weights_error: why the load_weights baseline could not be measured.
        layerwise_error: why the layerwise floor could not be measured.
        copy_seconds: one `copy_` of the trainer's weights, tensor by tensor, into a buffer already
            resident in this process (the median of `repeat`): the memory bound of any way in.
        layerwise_same: after the first (untimed) layerwise reload of the refit's own buckets the
            engine held exactly the bytes the refit had left (None: not measured, or nothing readable).
        put_back: after the first (untimed) load_weights call the engine held exactly its bytes
            from before it (its own tensors put back untouched; None: nothing readable to compare).
        bucket_bytes: the bucket size.
        trainer_peak_bytes: over one refit, the trainer's process's peak RSS above its RSS before
            the refit (colocated: the engine's worker is in that process too).
        engine_peak_bytes: over the same refit, the sum over the engine server's processes of each
            one's peak RSS above its RSS before (an upper bound of their joint peak growth; None:
            colocated, the engine is in the trainer's process).
        codec: the refit's codec path choice (app.services.codec_path.CodecPathChoice.to_dict).
        bf16_refit: a quantized preset's run: the same model's BF16 refits, measured in the same run
            by an engine of its own started after this one closed (empty: BF16, or it failed).
        bf16_phases: those BF16 refits by phase, the median.
        bf16_error: why the BF16 refits could not be measured.
    """

    deployment: str
    start: float
    refit: tuple[float, ...]
    write: tuple[float, ...] = ()
    reload: tuple[float, ...] = ()
    load_weights: tuple[float, ...] = ()
    source_bytes: int = 0
    sent_bytes: int = 0
    buckets: int = 0
    trainer_threads: int | None = None
    phases: dict[str, float] = attrs.field(factory=dict)
    same_bytes: bool | None = None
    moved: bool | None = None
    differing: tuple[str, ...] = ()
    reload_error: str | None = None
    load_weights_error: str | None = None
    put_back: bool | None = True
    bucket_bytes: int = 0
    trainer_peak_bytes: int | None = None
    engine_peak_bytes: int | None = None
    layerwise: tuple[float, ...] = ()
    layerwise_error: str | None = None
    layerwise_same: bool | None = None
    copy_seconds: float | None = None
    receive: tuple[float, ...] = ()
    transport: str | None = None
    codec: dict[str, Any] | None = None
    bf16_refit: tuple[float, ...] = ()
    bf16_phases: dict[str, float] = attrs.field(factory=dict)
    bf16_error: str | None = None
    unreadable: tuple[str, ...] = ()


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def resolve_deployment(deployment: str, engine_here: bool) -> str:
    """`auto` -> colocated when the engine imports in this process, else disaggregated."""
    if deployment != "auto":
        return deployment
    return "colocated" if engine_here else "disaggregated"


def skip_reason(deployment: str, baselines: EngineBaselines, *, engine_here: bool, engine_python: str | None = None,
                engine_python_has_it: bool | None = None) -> str | None:
    """Why the bench cannot run, or None.

    Args:
        deployment: colocated or disaggregated.
        baselines: the engine's (its name, and what to do).
        engine_here: the engine imports in this process.
        engine_python: the interpreter of the disaggregated engine's server.
        engine_python_has_it: the engine imports in that interpreter.
    """
    name = baselines.name
    if deployment == "colocated" and not engine_here:
        return f"refit bench engine, colocated, needs {name} in this process; {baselines.here}"
    if deployment == "disaggregated" and not engine_python_has_it:
        return (f"refit bench engine, disaggregated, starts a {name} server with {engine_python}, where {name} "
                f"does not import; {baselines.setup}")
    return None


def build_report(settings: EngineBenchSettings, t: EngineTimings) -> BenchReport:
    """The suite's rows and notes from what the engine measured (pure).

    Args:
        settings: what was run.
        t: the timings.

    Returns:
        The BenchReport: rl-refit's median refit against each baseline's median.
    """
    report = BenchReport("engine")
    labels = settings.baselines.labels
    case = f"{settings.model} {settings.preset.upper()} {t.deployment} bucket {settings.bucket_mb:g} MiB"
    ours = _median(t.refit)
    assert ours is not None, "at least one refit is measured"
    reload, write = _median(t.reload), _median(t.write)
    written = _median([w + r for w, r in zip(t.write, t.reload, strict=False)]) if t.reload else None
    load, layerwise, receive = _median(t.load_weights), _median(t.layerwise), _median(t.receive)
    metric = "refit time"
    if reload is not None:
        report.add(case, metric, ours, "s", labels["reload"], reload, figure="other", preset=settings.preset.upper())
    if layerwise is not None:
        report.add(case, metric, ours, "s", labels["layerwise"], layerwise, figure="other",
                   preset=settings.preset.upper())
    if receive is not None:
        report.add(case, metric, ours, "s", RECEIVE, receive, figure="other", preset=settings.preset.upper())
    if written is not None:
        report.add(case, metric, ours, "s", labels["write_reload"], written, figure="other",
                   preset=settings.preset.upper())
    if load is not None:
        report.add(case, metric, ours, "s", labels["load_weights"], load, figure="other", preset=settings.preset.upper())
    report.add(case, metric, ours, "s", RESTART, t.start, figure="other", preset=settings.preset.upper())
    if write is not None:
        report.add(case, "write checkpoint (quantize + one safetensors file)", write, "s")
    bf16 = _median(t.bf16_refit)
    if bf16 is not None:
        report.add(case, metric, ours, "s", BF16_REFIT, bf16, figure="other", preset=settings.preset.upper())
        if "quantize" in t.phases:
            report.add(case, "quantize phase of the refit", t.phases["quantize"], "s", BF16_REFIT, bf16)
    if t.source_bytes:
        bound = t.source_bytes / 1e9 / t.copy_seconds if t.copy_seconds else None
        report.add(case, "rl-refit refit throughput (BF16 source bytes)", t.source_bytes / 1e9 / ours, "GB/s",
                   COPY if bound is not None else None, bound)
    mib = 2**20
    if t.trainer_peak_bytes is not None and t.bucket_bytes:
        report.add(case, "trainer process: peak RSS during a refit above its RSS before", t.trainer_peak_bytes / mib,
                   "MiB", "bound: 2 buckets", 2 * t.bucket_bytes / mib, figure="memory")
    if t.engine_peak_bytes is not None and t.source_bytes:
        report.add(case, "engine processes: peak RSS growth during a refit (sum over processes)",
                   t.engine_peak_bytes / mib, "MiB", "a second copy of the model (BF16 source bytes)",
                   t.source_bytes / mib, figure="memory")
    report.notes += _notes(settings, t)
    split = time_split(ours, receive, load, layerwise, settings.baselines.terms)
    if split is not None:
        report.notes.append(split)
    target = speed_target(ours, reload, layerwise, settings.baselines.terms)
    if target is not None:
        report.notes.append(target)
    report.notes += _quantized_notes(settings, t, ours, bf16)
    return report


def _quantized_notes(settings: EngineBenchSettings, t: EngineTimings, ours: float, bf16: float | None) -> list[str]:
    notes = []
    if t.codec is not None:
        notes.append(f"codec path: {t.codec['path']} ({t.codec['reason']}); chosen before the first refit, "
                     f"outside every timing (warm-up {t.codec['warmup_seconds']:.1f} s)")
    if bf16 is not None:
        verdict = "met" if ours <= QUANTIZED_BOUND * bf16 else "NOT met"
        phases = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in t.bf16_phases.items())
        notes.append(f"bound: {verdict}, the {settings.preset.upper()} refit takes {ours / bf16:.2f}x the BF16 refit "
                     f"of the same model (at most {QUANTIZED_BOUND:g}x); the BF16 refits by phase, median ms: {phases} "
                     "(an engine of their own, started after this one closed, same threads and buckets)")
    if t.bf16_error:
        notes.append(f"the BF16 refit of the same model could not be measured: {t.bf16_error}")
    return notes


def time_split(refit: float, receive: float | None, load: float | None, layerwise: float | None,
               terms: Mapping[str, str]) -> str | None:
    """Where the refit's time goes, from the floors of one run, each one a way in that does less
    than the next: the trainer's side and the transport, plus the engine's loaders, plus its
    processing, plus rl-refit's own checks in the worker and around it (the refit). None: a floor
    is missing. `terms`: how the engine's ways in are named (EngineBaselines.terms)."""
    if receive is None or load is None or layerwise is None:
        return None
    steps = (("the trainer's side and the transport (export, quantize, pack, hand-over: the buckets made, sent "
              "and dropped)", receive),
             (f"{terms['load']} (the unprocessed floor less the transport)", load - receive),
             (f"{terms['processing']} (the layerwise floor less the unprocessed one)", layerwise - load),
             ("rl-refit's own checks (the refit less the layerwise floor: the storage check, the expert redo, "
              "the KV-scale reset, the audit, the tied head)", refit - layerwise))
    parts = [f"{what} {seconds:.3f} s" if seconds >= 0 else f"{what} none measurable ({seconds:.3f} s)"
             for what, seconds in steps]
    return ("where the refit's time goes, from the floors of the same run (a negative share: the floors' "
            "own overheads or the machine's noise exceed it): " + "; ".join(parts))


def speed_target(refit: float, reload: float | None, floor: float | None, terms: Mapping[str, str]) -> str | None:
    """Where the refit stands against its bound, in words (None: the reload from disk not measured).

    The bound: at most half of the engine's reload from a page-cached file; where the engine's own
    loading and processing (the layerwise floor) cost more than half of that reload, that floor
    bounds every way in, and the refit is held to at most 1.25x the floor instead. `terms`: how the
    engine's ways in are named (EngineBaselines.terms).
    """
    if reload is None:
        return None
    if refit <= reload / 2:
        return f"bound: met, the refit takes {refit / reload:.2f}x {terms['reload']} (at most 0.5x)"
    if floor is not None and floor > reload / 2:
        verdict = "met" if refit <= 1.25 * floor else "NOT met"
        return (f"bound: {verdict}, the refit takes {refit / floor:.2f}x {terms['layerwise']} (at most 1.25x), "
                f"which itself takes {floor / reload:.2f}x {terms['reload']} (over 0.5x: {terms['loading']}, "
                "through these buckets and this transport, bound every way in through them)")
    return (f"bound: NOT met, the refit takes {refit / reload:.2f}x {terms['reload']} (at most 0.5x"
            + (f"; the layerwise floor takes {floor / reload:.2f}x {terms['reload']}" if floor is not None else "")
            + ")")


def _notes(settings: EngineBenchSettings, t: EngineTimings) -> list[str]:
    base = settings.baselines
    told, terms = base.notes, base.terms
    rounds = (f"median of {settings.repeat} round{'s' if settings.repeat > 1 else ''} in turns after a "
              "warm-up round")
    start = told["start_colocated"] if t.deployment == "colocated" else told["start_disaggregated"]
    notes = [
        f"one engine, {t.deployment}: every figure is wall-clock seconds in the trainer's process, {rounds}; "
        f"{t.buckets} buckets, {t.sent_bytes / 2**20:.2f} MiB sent per refit "
        f"({t.source_bytes / 2**20:.2f} MiB of BF16 source weights)",
        "ratio = baseline / rl-refit (above 1: the refit is faster)",
        f"engine start ({t.start:.1f} s): {start}",
        *([f"the buckets reached {terms['server']}'s workers through the {_TRANSPORTS.get(t.transport, t.transport)} "
           f"({told['transport_key']}={t.transport})"] if t.transport else []),
        *([f"the trainer's process ran with {t.trainer_threads} torch thread{'s' if t.trainer_threads > 1 else ''}, "
           f"the other cores left to {terms['server']} ({told['threads']})"]
          if t.trainer_threads else []),
        "per-bucket load_weights: the same buckets and transport, each bucket straight into "
        "model.load_weights with no layerwise reload and no processing, into checkpoint-format "
        "parameters set up beside the engine's processed ones (put back afterwards): a timing floor, "
        f"not a refit; its writes never reach the kernels ({told['load_weights']})",
    ]
    if t.phases:
        notes.append(_phases_note(t, terms))
    if t.trainer_peak_bytes is not None:
        notes.append(
            "memory rows: one more refit after the timed rounds, each process's peak RSS (VmHWM) reset just before "
            "it; the trainer's row counts what the refit adds to the trainer's process (the trainer's model is "
            "already resident: the bound for the whole process is the model's bytes plus 2 buckets); the engine's "
            "row adds up each engine process's own peak growth (an upper bound of their joint peak); ratio = "
            "bound / value (1 or more: within)"
            + ("; colocated, the engine's worker runs in the trainer's process, so its row is the trainer's"
               if t.engine_peak_bytes is None else ""))
    notes += _bytes_notes(settings, t)
    if t.unreadable:
        notes.append(f"{len(t.unreadable)} parameters were not compared byte for byte, in any of these comparisons: "
                     f"the engine keeps them packed outside their (empty) tensor ({', '.join(t.unreadable[:3])}"
                     f"{', ...' if len(t.unreadable) > 3 else ''}); the comparisons cover the other parameters and "
                     "buffers")
    if t.reload_error:
        notes.append(f"{terms['reload']} could not be measured: {t.reload_error}")
    if t.load_weights_error:
        notes.append(f"the per-bucket load_weights baseline could not be measured: {t.load_weights_error}")
    if t.layerwise_error:
        notes.append(f"the layerwise floor could not be measured: {t.layerwise_error}")
    if t.layerwise_same is False:
        notes.append(f"{terms['layerwise']} left the engine holding other bytes than the refit "
                     f"({told['layerwise_differs']})")
    if t.put_back is False:
        notes.append("after the first per-bucket load_weights call the engine did NOT hold its bytes from before it: "
                     "putting its own tensors back failed, and every later figure is suspect")
    return notes


_TRANSPORTS = {"shm": "shared-memory ring", "gloo": "side group's stream (gloo)"}


def _phases_note(t: EngineTimings, terms: Mapping[str, str]) -> str:
    where = (f"load: each bucket into the engine, {terms['loading']} included; "
             "finalize: the reload's last layers, the expert redo, the KV-scale reset"
             if t.deployment == "colocated" else
             f"load: each bucket into the {_TRANSPORTS.get(t.transport or '', 'transport')}; finalize: waiting for "
             f"the server's workers to receive and load the stream ({terms['loading']}), then its finalize")
    ms = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in t.phases.items())
    parts = [v for k, v in t.phases.items() if k != "total"]
    rest = t.phases.get("total", 0.0) - sum(parts)
    untimed = (f"; the median total less the phases' medians, about {rest * 1e3:.1f} ms: the begin (the storage fingerprint, "
               "the engine's begin), not a phase of its own" if rest > 0 and "total" in t.phases else "")
    return f"rl-refit's refit by phase, median ms: {ms} ({where}; verify: the storage check{untimed})"


def _bytes_notes(settings: EngineBenchSettings, t: EngineTimings) -> list[str]:
    terms, told = settings.baselines.terms, settings.baselines.notes
    if t.moved is False:
        return ["the bytes were not compared: a refit of perturbed trainer weights left the engine's bytes "
                "unchanged, so a reload that did nothing would have looked the same"]
    if t.same_bytes is None:
        return []
    start = ("from an engine holding other weights (a refit of perturbed trainer weights)" if t.moved
             else "from the same weights (the trainer cannot be perturbed: this only shows the reload "
                  "did not change them)")
    if t.same_bytes:
        which = "every parameter and buffer it could read" if t.unreadable else "every parameter and buffer"
        return [f"{terms['reload']} of the checkpoint, {start}, left the engine holding exactly the bytes "
                f"rl-refit's refit had left ({which})"]
    why = f" ({told['reload_differs_bf16']})" if settings.preset.upper() == "BF16" else ""
    return [f"{terms['reload']} of the checkpoint, {start}, left the engine holding different bytes "
            f"than rl-refit's refit in {', '.join(t.differing)}{why}"]


# --- measuring ---------------------------------------------------------------------------------


def _engine_here(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _config(settings: EngineBenchSettings, deployment: str) -> RefitConfig:
    from app.services.demo_config import engine_config, with_engine_args
    from app.services.engine_demo import EngineDemoSettings
    from domain.quant.plan import QuantizationPlan

    preset = None if settings.preset.upper() == "BF16" else settings.preset.upper()
    demo = EngineDemoSettings(engine=settings.engine, deployment=deployment,
                              plan=QuantizationPlan.from_presets(preset, preset), model=settings.model)
    config = engine_config(demo, settings.bucket_mb)
    return with_engine_args(config, worker_extension_cls=settings.baselines.extension)


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@attrs.define
class _Bench:
    """One engine and the ways into it: rl-refit's refit and the baselines."""

    services: Any
    svc: Any  # RefitService
    workdir: Path
    baselines: EngineBaselines
    timings: list[dict[str, float]] = attrs.field(factory=list)  # each refit's phases

    @property
    def engine(self) -> Any:
        return self.svc.engine

    def digests(self) -> dict[str, str]:
        return self.engine.digests()

    def mode(self, mode: str) -> None:
        self.baselines.mode(self.engine, mode)

    def refit(self) -> None:
        self.timings.append(dict(self.svc.refit().timings))

    def write(self) -> None:
        from safetensors.torch import save_file

        tensors = {name: t.contiguous() for name, t in self.quantized()}
        save_file(tensors, str(self.workdir / "model.safetensors"), metadata={"format": "pt"})

    def quantized(self) -> Any:
        """The refit's checkpoint tensors, quantized on the refit's codec path."""
        from app.services.codec_path import on_path
        from domain.quant.stream import quantize_stream

        svc = self.svc
        return on_path(svc.codec_choice().path, quantize_stream(svc.plan, svc.trainer.named_weights()))

    def reload(self) -> None:
        self.baselines.reload(self.engine, str(self.workdir))

    def buckets_only(self) -> None:
        """The refit's buckets, through the same workers and ownership, with nothing else around
        them (the workers' bench mode says what they do with them: a floor)."""
        svc, workers = self.svc, self.baselines.stream(self.engine)
        planner = svc.ownership.planner(svc.bucket_bytes, svc.alignment)
        workers.begin()
        for bucket in planner.pack(self.quantized()):
            workers.load(bucket)
        workers.finalize(False)


Around = dict[str, tuple[Callable[[], object], Callable[[], object]]]


def _rounds(fns: dict[str, Callable[[], object]], repeat: int, around: Around | None = None) -> dict[str, list[float]]:
    """One warm-up round, then `repeat` rounds in turns (the order reversed every other round).

    Args:
        fns: name -> the call to time.
        repeat: measured rounds.
        around: name -> (enter, leave), called untimed before and after each of that name's
            calls (leave also when the call raises).

    Returns:
        Each name's seconds, one per measured round.
    """
    around = around or {}

    def call(name: str) -> float:
        enter, leave = around.get(name, (_nothing, _nothing))
        enter()
        try:
            return _timed(fns[name])
        finally:
            leave()

    for name in fns:
        call(name)
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    for i in range(repeat):
        for name in order if i % 2 == 0 else reversed(order):
            times[name].append(call(name))
    return times


def _nothing() -> None:
    return None


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"


def measure(settings: EngineBenchSettings) -> EngineTimings:
    """Start one engine and measure every path into it.

    Raises:
        ModuleNotFoundError: (name: the engine's package) with the reason, when the engine is not
            where this deployment needs it.
    """
    from app.bootstrap import bootstrap

    package = plugin_for(settings.engine).package or settings.engine
    here = _engine_here(package)
    deployment = resolve_deployment(settings.deployment, here)
    services = bootstrap(_config(settings, deployment))
    services.check_checkpoint_config()  # a malformed config.json is one line, before any engine or model is built
    python = services.engines.server_python(settings.engine) if deployment == "disaggregated" else None
    reason = skip_reason(deployment, settings.baselines, engine_here=here, engine_python=python,
                         engine_python_has_it=python_has(python, package) if python else None)
    if reason is not None:
        raise ModuleNotFoundError(reason, name=package)
    if deployment == "colocated":  # imported before the clock starts: the start is the engine's alone
        importlib.import_module(package)
    trainer = services.trainer_model()
    t0 = time.perf_counter()
    engine: Any = services.rollout_engine()  # (close)
    start = time.perf_counter() - t0
    try:
        with tempfile.TemporaryDirectory(prefix="rl-refit-bench-engine-") as tmp:
            bench = _Bench(services, services.refit_service(engine=engine, trainer=trainer), Path(tmp),
                           settings.baselines)
            return _measure(settings, deployment, start, bench)
    finally:
        engine.close()


def _measure(settings: EngineBenchSettings, deployment: str, start: float, bench: _Bench) -> EngineTimings:
    threads = settings.trainer_threads_for(deployment, os.cpu_count() or 1, torch.cuda.is_available())
    if threads is not None:  # run() puts the process's threads back
        torch.set_num_threads(threads)
    first = bench.svc.refit()  # the engine goes live
    after_refit = bench.digests()
    bench.write()
    moved = _move_away(bench, after_refit)
    reload_error = _attempt(bench.reload)  # the engine's own path: a failure is reported, the rest measured
    after_reload = bench.digests() if reload_error is None else None
    bench.refit()  # rl-refit's weights again (after a failed reload too)
    floor = (lambda: bench.mode("load_weights"), lambda: bench.mode("refit"))
    layerwise = (lambda: bench.mode("layerwise"), lambda: bench.mode("refit"))
    receive = (lambda: bench.mode("receive"), lambda: bench.mode("refit"))
    before_floor = bench.digests()
    layerwise_error = _attempt(bench.buckets_only, *layerwise)
    layerwise_same = DigestComparison.of(before_floor, bench.digests()).same if layerwise_error is None else None
    bench.refit()  # whatever the layerwise reload skipped is rl-refit's again
    before_floor = bench.digests()
    load_error = _attempt(bench.buckets_only, *floor)
    put_back = DigestComparison.of(before_floor, bench.digests()).same
    fns: dict[str, Callable[[], object]] = {"refit": bench.refit}
    if reload_error is None:
        fns.update(write=bench.write, reload=bench.reload)
    if layerwise_error is None:
        fns["layerwise"] = bench.buckets_only
    if load_error is None:
        fns["load_weights"] = bench.buckets_only
    if _attempt(bench.buckets_only, *receive) is None:
        fns["receive"] = bench.buckets_only
    times = _rounds(fns, settings.repeat, {"load_weights": floor, "layerwise": layerwise, "receive": receive})
    phases = _median_phases(bench.timings[-settings.repeat:])
    reloaded = None if after_reload is None else DigestComparison.of(after_refit, after_reload)
    differing = () if reloaded is None else reloaded.differing
    copy = _copy_bound(bench.svc.trainer, settings.repeat)
    trainer_peak, engine_peak = _refit_memory(bench)  # the engine ends serving rl-refit's refit
    return EngineTimings(
        deployment, start, tuple(times["refit"]), tuple(times.get("write", ())), tuple(times.get("reload", ())),
        tuple(times.get("load_weights", ())), first.source_bytes, first.bytes_sent, first.buckets, threads, phases,
        reloaded.same if reloaded is not None and moved is not False else None,
        moved if after_reload is not None else None, differing[:10],
        reload_error, load_error, put_back, bench.svc.bucket_bytes, trainer_peak, engine_peak,
        tuple(times.get("layerwise", ())), layerwise_error, layerwise_same, copy, tuple(times.get("receive", ())),
        transport=getattr(bench.engine.workers, "transport_used", None), codec=bench.svc.codec_choice().to_dict(),
        unreadable=DigestComparison.of(after_refit, after_refit).unreadable,
    )


_BF16_MARK = "rl-refit-bf16-refits "
_BF16_CHILD = "import sys; from app.bench.engine import bf16_refits_child; bf16_refits_child(sys.argv[1])"


def bf16_refits_child(settings_json: str) -> None:
    """In a child process: start the settings' engine (BF16), refit once, then measure `repeat`
    refits after a warm-up one; print their seconds and median phases as one marked JSON line."""
    import json

    from app.bootstrap import bootstrap
    from app.logging import configure_logging

    configure_logging(level=logging.WARNING)
    settings = EngineBenchSettings(**json.loads(settings_json))
    services = bootstrap(_config(settings, settings.deployment))
    threads = settings.trainer_threads_for(settings.deployment, os.cpu_count() or 1, torch.cuda.is_available())
    if threads is not None:
        torch.set_num_threads(threads)
    trainer = services.trainer_model()
    engine: Any = services.rollout_engine()
    try:
        svc = services.refit_service(engine=engine, trainer=trainer)
        svc.refit()
        times = _rounds({"refit": lambda: svc.refit()}, settings.repeat)["refit"]
        phases = _median_phases([dict(r.timings) for r in svc.reports[-settings.repeat:]])
    finally:
        engine.close()
    sys.stdout.write(_BF16_MARK + json.dumps({"refit": times, "phases": phases}) + "\n")


def _bf16_refits(settings: EngineBenchSettings, deployment: str) -> dict[str, Any]:
    """The same model's BF16 refits, in a child process (one engine at a time: this run's engine is
    closed): EngineTimings' bf16_refit, bf16_phases, bf16_error."""
    import json

    child = attrs.evolve(settings, preset="BF16", deployment=deployment)
    try:
        done = subprocess.run([sys.executable, "-c", _BF16_CHILD, json.dumps(attrs.asdict(child))],
                              capture_output=True, text=True, timeout=3600)  # this environment, inherited
    except (OSError, subprocess.SubprocessError) as err:
        return {"bf16_error": _error(err)}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(_BF16_MARK):
            out = json.loads(line[len(_BF16_MARK):])
            return {"bf16_refit": tuple(out["refit"]), "bf16_phases": out["phases"]}
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return {"bf16_error": f"the child exited with {done.returncode}: {tail}"}


def _copy_bound(trainer: Any, repeat: int) -> float:
    """Seconds of one `copy_` of every trainer weight into one resident buffer (the largest
    tensor's bytes, reused: the destination's pages are mapped before the clock starts), the
    median of `repeat` passes after a warm-up pass."""
    weights = [t.detach().reshape(-1).view(torch.uint8) for _, t in trainer.named_weights()
               if t.is_contiguous() and t.numel()]
    out = torch.empty(max((t.numel() for t in weights), default=0), dtype=torch.uint8)

    def once() -> None:
        for t in weights:
            out[: t.numel()].copy_(t)

    once()
    return statistics.median(_timed(once) for _ in range(repeat))


def _refit_memory(bench: _Bench) -> tuple[int, int | None]:
    """One refit with the peak RSS of every process reset before it: the trainer's process's peak
    above its RSS before, and the sum of the engine server's processes' peaks above theirs (None
    colocated). Bytes."""
    from app.bench.memory import process_kib, process_tree, reset_peak_rss

    # the server rl-refit started (an attached engine's workers reach it through their control)
    server = getattr(getattr(getattr(bench.engine, "workers", None), "control", None), "server", None)
    pids = process_tree(server.proc.pid) if server is not None else []
    engine_base = {pid: reset_peak_rss(pid) for pid in pids}
    base = reset_peak_rss()
    bench.svc.refit()
    trainer = max(0, process_kib("VmHWM") - base) * 1024  # a page freed since the reset: no growth
    if server is None:
        return trainer, None
    return trainer, sum(max(0, process_kib("VmHWM", pid) - kib) for pid, kib in engine_base.items()) * 1024


def _attempt(fn: Callable[[], object], enter: Callable[[], object] = _nothing,
             leave: Callable[[], object] = _nothing) -> str | None:
    """Run a baseline once, untimed; why it failed, or None."""
    enter()
    try:
        fn()
    except Exception as err:  # a baseline's failure is a finding to report, not the suite's failure
        return _error(err)
    finally:
        leave()
    return None


def _move_away(bench: _Bench, digests: dict[str, str]) -> bool | None:
    """Refit perturbed trainer weights (then restore the trainer), so that the reload compared
    next has to change the engine's bytes; whether they changed (None: the trainer cannot be
    perturbed, or no parameter's bytes could be read: packed ones are not compared)."""
    trainer = bench.svc.trainer
    if not all(hasattr(trainer, m) for m in ("snapshot", "perturb_", "restore_")):
        return None
    kept = trainer.snapshot()
    try:
        trainer.perturb_(seed=1, scale=0.05)
        bench.svc.refit()
    finally:
        trainer.restore_(kept)
    same = DigestComparison.of(digests, bench.digests()).same
    return None if same is None else not same


def _median_phases(timings: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each phase's median over refits (phases in the first refit's order)."""
    if not timings:
        return {}
    return {k: statistics.median(t.get(k, 0.0) for t in timings) for k in timings[0]}


def run(quick: bool = False, settings: EngineBenchSettings | None = None) -> BenchReport:
    """Run the suite.

    Args:
        quick: micro-moe, 3 rounds (well under 3 minutes with the engine's start) instead of
            tiny-moe, 7 rounds.
        settings: what to run (default: `EngineBenchSettings.defaults(quick)`).

    Returns:
        The BenchReport. Raises ModuleNotFoundError (the engine's package, the reason in its
        message) when the engine is not where the deployment needs it: `refit bench all` reports
        the suite skipped.
    """
    from app.logging import configure_logging

    settings = settings or EngineBenchSettings.defaults(quick)
    configure_logging(level=logging.WARNING)  # the canonical refit lines would flood the table
    threads = torch.get_num_threads()
    load_before = _load_average()
    try:
        timings = measure(settings)
    finally:
        torch.set_num_threads(threads)  # an engine in this process may lower its threads
    if settings.preset.upper() != "BF16":
        timings = attrs.evolve(timings, **_bf16_refits(settings, timings.deployment))
    report = build_report(settings, timings)
    report.notes.append(f"load average (1 min) before and after: {load_before} and {_load_average()} on "
                        f"{os.cpu_count()} cores (other work on the machine skews every timing)")
    return report


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None
