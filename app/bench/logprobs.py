"""`refit bench logprobs`: fused log-prob/entropy against the plain log_softmax path, same run.

For each token count T, both paths compute log p(label) and the entropy from hidden [T, H] and
an output weight [V, H] (vocab 151,936, hidden 2,048 in the full run), forward and backward
(gradients for the hidden states and the weight), and forward only without autograd (how old
and reference log-probs are computed). Per path it reports the median time and the peak memory:

- "peak memory": every byte allocated inside the measured call, gradients included;
- "peak working memory": the same without the returned gradients (the weight gradient is
  parameter-sized in both paths; Megatron keeps it in its preallocated gradient buffer).

Peak memory on CUDA comes from the allocator's statistics; on CPU from
`app.bench.memory.TensorBytesTracker` (bytes of tensors allocated by each aten operator, freed
when their storage dies; see that module). The plain path is skipped, with a note, where its
estimated [T, V] buffers do not fit in the memory available.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch

from app.bench.memory import TensorBytesTracker
from app.bench.report import BenchReport
from domain.forward.fused_logprob import (
    DEFAULT_CHUNK_BYTES,
    auto_chunk_size,
    fused_logprob_entropy,
    reference_logprob_entropy,
)

GIB = 2**30
FULL = dict(vocab=151_936, hidden=2_048, tokens=(1_024, 4_096, 16_384), chunk_bytes=DEFAULT_CHUNK_BYTES)
QUICK = dict(vocab=8_192, hidden=256, tokens=(256, 1_024), chunk_bytes=4 * 2**20)
# Timed calls per measurement (the memory-tracked call is one of them): fewer for large cases,
# whose single calls run for many seconds.
SMALL_CASE_ELEMENTS, SMALL_CASE_SAMPLES = 2 * 10**8, 3
PLAIN_BUFFERS = 5  # [T, V] float32 buffers the plain path holds at its peak (measured: 4), plus margin
TARGET_T, TARGET_MEMORY_RATIO = 4_096, 16.0

Path = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _available_bytes() -> int | None:
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _inputs(tokens: int, vocab: int, hidden: int, device: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(tokens)
    h = torch.randn(tokens, hidden, generator=gen).to(device).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * hidden**-0.5).to(device).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    return h, w, y


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _train_step(path: Path, h, w, y, device: str) -> Callable[[], None]:
    def step() -> None:
        lp, ent = path(h, w, y, temperature=0.9)
        (lp.sum() + 0.1 * ent.sum()).backward()
        _sync(device)

    return step


def _tracked(fn: Callable[[], None], h, w, device: str) -> tuple[float, float, float]:
    """(peak GiB, peak GiB without the gradients, seconds) of one call."""
    h.grad = w.grad = None
    gc.collect()
    started = time.perf_counter()
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        peak = torch.cuda.max_memory_allocated() - base
        # The gradients are alive at the end; on CUDA only their final size can be taken off.
        grads = sum(t.numel() * t.element_size() for t in (h.grad, w.grad) if t is not None)
        working = max(0, peak - grads)
    else:
        with TensorBytesTracker() as tracker:
            fn()
        peak, working = tracker.peak_bytes, tracker.peak_bytes_without([h.grad, w.grad])
    seconds = time.perf_counter() - started
    h.grad = w.grad = None
    return peak / GIB, working / GIB, seconds


def _median_seconds(fn: Callable[[], None], h, w, first: float, samples: int) -> float:
    """Median of `first` (the tracked call) and `samples - 1` more calls."""
    times = [first]
    for _ in range(samples - 1):
        h.grad = w.grad = None
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    h.grad = w.grad = None
    return statistics.median(times)


def _measure_path(path: Path, h, w, y, device: str, samples: int) -> dict[str, float]:
    step = _train_step(path, h, w, y, device)
    peak, working, first = _tracked(step, h, w, device)
    seconds = _median_seconds(step, h, w, first, samples)

    def forward_only() -> None:
        with torch.no_grad():
            path(h, w, y, temperature=0.9)
        _sync(device)

    fwd_peak, _, fwd_first = _tracked(forward_only, h, w, device)
    fwd_seconds = _median_seconds(forward_only, h, w, fwd_first, samples)
    return dict(seconds=seconds, peak=peak, working=working, fwd_seconds=fwd_seconds, fwd_peak=fwd_peak)


def run(quick: bool = False) -> BenchReport:
    """Fused vs plain log-probs, forward+backward and forward only; see the module docstring."""
    cfg = QUICK if quick else FULL
    vocab, hidden = int(cfg["vocab"]), int(cfg["hidden"])  # type: ignore[call-overload]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    chunk = auto_chunk_size(vocab, chunk_bytes=int(cfg["chunk_bytes"]))  # type: ignore[call-overload]
    report = BenchReport("logprobs")

    def fused(h, w, y, temperature):
        return fused_logprob_entropy(h, w, y, temperature=temperature, chunk_size=chunk)

    results: dict[int, dict[str, dict[str, float]]] = {}
    for tokens in cfg["tokens"]:  # type: ignore[attr-defined]
        case = f"T={tokens} V={vocab} H={hidden} fp32"
        h, w, y = _inputs(tokens, vocab, hidden, device)
        samples = SMALL_CASE_SAMPLES if tokens * vocab <= SMALL_CASE_ELEMENTS else 1
        res = {"fused": _measure_path(fused, h, w, y, device, samples)}
        need = PLAIN_BUFFERS * tokens * vocab * 4
        avail = _available_bytes()
        if avail is not None and need > 0.8 * avail:
            report.notes.append(
                f"{case}: plain path skipped, its [T, V] buffers need about {need / GIB:.1f} GiB and "
                f"{avail / GIB:.1f} GiB are available"
            )
        else:
            res["plain"] = _measure_path(reference_logprob_entropy, h, w, y, device, samples)
        results[tokens] = res
        _add_rows(report, case, res)
        del h, w, y
        gc.collect()
    _add_notes(report, results, chunk, device)
    return report


def _add_rows(report: BenchReport, case: str, res: dict[str, dict[str, float]]) -> None:
    f, p = res["fused"], res.get("plain")
    base = "plain log_softmax"
    for metric, key, unit in (
        ("fwd+bwd time", "seconds", "s"),
        ("fwd+bwd peak memory", "peak", "GiB"),
        ("fwd+bwd peak working memory (without gradients)", "working", "GiB"),
        ("forward-only time (no grad)", "fwd_seconds", "s"),
        ("forward-only peak memory (no grad)", "fwd_peak", "GiB"),
    ):
        report.add(case, metric, f[key], unit, base if p else None, p[key] if p else None)


def _add_notes(report: BenchReport, results: dict[int, dict[str, dict[str, float]]], chunk: int, device: str) -> None:
    report.notes.append(
        f"fused chunk: {chunk} tokens; device {device}; "
        + ("peak memory from torch.cuda statistics" if device == "cuda" else
           "peak memory on CPU from TensorBytesTracker (bytes of tensors allocated per aten operator, "
           "see app/bench/memory.py)")
    )
    report.notes.append("ratio = plain / fused (x less memory, x faster); inputs and weights are not counted")
    report.notes.append(
        f"times: median of {SMALL_CASE_SAMPLES} calls up to "
        f"{SMALL_CASE_ELEMENTS:.0e} logits (T x V), 1 call above; the first call runs under the memory tracker"
    )
    target = results.get(TARGET_T, {})
    if "plain" in target:
        f, p = target["fused"], target["plain"]
        mem = p["working"] / f["working"] if f["working"] else float("inf")
        total = p["peak"] / f["peak"] if f["peak"] else float("inf")
        speed = p["seconds"] / f["seconds"]
        report.notes.append(
            f"target at T={TARGET_T}: working memory {mem:.1f}x less (target >= {TARGET_MEMORY_RATIO:.0f}x: "
            f"{'met' if mem >= TARGET_MEMORY_RATIO else 'not met'}), total peak {total:.1f}x less, "
            f"fwd+bwd speed {speed:.2f}x of plain (target >= 1: {'met' if speed >= 1 else 'not met'})"
        )
