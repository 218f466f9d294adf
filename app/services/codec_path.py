"""Which codec path a refit quantizes with: the native kernels, else the compiled fast path, where
it is bit-identical and faster on this machine, else the eager reference
(docs/refit.md#the-codec-path).

The choice is made once per RefitService, before its first refit and outside its timings. Each
fast path in turn (native first, where the composition root gave a way to build its kernels;
then compiled) quantizes the trainer's weights once (the warm-up: building the native kernels,
or compiling one kernel per format, rule, dtype and row length of the model), then it and the
eager path quantize them again, in turns tensor by tensor, and every output is compared byte for
byte. The first fast path whose bytes are all equal and that took less time is chosen; otherwise
the refit stays eager and says why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import attrs
import structlog
import torch

from domain.quant.codecs.compile import CodecPath, use
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import quantize_stream
from ports.trainer_model import TrainerModel

# Below this many bytes of weights to quantize, the eager path quantizes in about 0.1 s on 2 CPU
# cores, less than the compiled path's warm-up costs for many refits: the refit stays eager.
AUTO_MIN_BYTES = 128 << 20
POLICIES = ("auto", "eager")


@attrs.frozen
class CodecPathChoice:
    """The codec path of a refit service, and why.

    Attributes:
        path: eager, compiled or native.
        reason: why, in words (for each fast path tried).
        warmup_seconds: the chosen (else the last tried) fast path's first pass over the model,
            0 when none was tried.
        eager_seconds: quantizing the model eagerly, in the comparison (0 when not compared).
        compiled_seconds: quantizing it on that fast path, warm, in the comparison (0 when not
            compared).
    """

    path: CodecPath
    reason: str
    warmup_seconds: float = 0.0
    eager_seconds: float = 0.0
    compiled_seconds: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path.value, "reason": self.reason, "warmup_seconds": self.warmup_seconds,
                "eager_seconds": self.eager_seconds, "compiled_seconds": self.compiled_seconds}


def on_path(path: CodecPath, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`items` (a quantize_stream), each one computed with the codecs on `path`.

    The path is a context variable; a generator runs in its consumer's context, so each step
    sets it for itself.
    """
    it = iter(items)
    while True:
        with use(path):
            try:
                item = next(it)
            except StopIteration:
                return
        yield item
        del item


def _quantized_bytes(plan: QuantizationPlan, trainer: TrainerModel) -> int:
    return sum(t.numel() * t.element_size() for name, t in trainer.named_weights()
               if plan.decide(name, tuple(t.shape)).is_quantized)


def _compare(plan: QuantizationPlan, trainer: TrainerModel,
             fast: CodecPath = CodecPath.COMPILED) -> tuple[str | None, float, float]:
    """The eager and the `fast` path over the model, in turns tensor by tensor: the first tensor
    whose bytes differ (None: none), and each path's seconds."""
    times = {CodecPath.EAGER: 0.0, fast: 0.0}
    streams = {path: on_path(path, quantize_stream(plan, trainer.named_weights())) for path in times}
    while True:
        out = {}
        for path, stream in streams.items():
            t0 = time.perf_counter()
            out[path] = next(stream, None)
            times[path] += time.perf_counter() - t0
        eager, other_out = out[CodecPath.EAGER], out[fast]
        if eager is None or other_out is None:
            if eager is not other_out:
                return "the two paths yielded different numbers of tensors", times[CodecPath.EAGER], 0.0
            return None, times[CodecPath.EAGER], times[fast]
        (name, a), (other, b) = eager, other_out
        if name != other or a.dtype != b.dtype or a.shape != b.shape or not torch.equal(
                a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
            return name, times[CodecPath.EAGER], times[fast]


def choose_codec_path(plan: QuantizationPlan, trainer: TrainerModel, policy: str = "auto",
                      *, min_bytes: int | None = None,
                      native: Callable[[], str | None] | None = None) -> CodecPathChoice:
    """Choose the path a refit of `trainer` under `plan` quantizes with.

    Args:
        plan: the rollout plan.
        trainer: the trainer whose weights are refitted.
        policy: auto (the native, else the compiled path, where it is bit-identical and faster)
            or eager.
        min_bytes: auto keeps a model with fewer bytes to quantize eager, untried (None:
            AUTO_MIN_BYTES).
        native: builds and installs the native kernels, returning None, or why they are not
            there (the composition root's `native_codecs`); None: the native path is not tried.

    Returns:
        The choice; a fast path that fails to build or compile (no C++ compiler, an unsupported
        torch) is passed over, with the error in the reason.
    """
    if policy not in POLICIES:
        raise ValueError(f"codec path policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if not plan.is_quantized:
        return CodecPathChoice(CodecPath.EAGER, "nothing is quantized (BF16)")
    if policy == "eager":
        return CodecPathChoice(CodecPath.EAGER, "eager by request")
    min_bytes = AUTO_MIN_BYTES if min_bytes is None else min_bytes
    nbytes = _quantized_bytes(plan, trainer)
    if nbytes < min_bytes:
        return CodecPathChoice(CodecPath.EAGER, f"{nbytes / 2**20:.0f} MiB to quantize, under {min_bytes >> 20} MiB: "
                               "compiling would cost more than it saves")
    reasons: list[str] = []
    last = CodecPathChoice(CodecPath.EAGER, "")
    for fast in (CodecPath.NATIVE, CodecPath.COMPILED):
        if fast is CodecPath.NATIVE:
            missing = "no native kernels were offered" if native is None else native()
            if missing is not None:
                reasons.append(missing)
                continue
        tried = _try(plan, trainer, fast)
        if tried.path is fast:
            return attrs.evolve(tried, reason="; ".join([*reasons, tried.reason]))
        reasons.append(tried.reason)
        last = tried
    return attrs.evolve(last, path=CodecPath.EAGER, reason="; ".join(reasons))


def _try(plan: QuantizationPlan, trainer: TrainerModel, fast: CodecPath) -> CodecPathChoice:
    """`fast` warmed up over the model, then compared with eager: chosen (its path) or not
    (eager), and why."""
    t0 = time.perf_counter()
    try:
        for _ in on_path(fast, quantize_stream(plan, trainer.named_weights())):
            pass
    except Exception as err:  # a fast path is optional: any failure leaves the reference path
        structlog.get_logger().warning(f"the {fast.value} codec path is unavailable; not using it",
                                       error=f"{type(err).__name__}: {err}")
        first_line = str(err).splitlines()[0][:200] if str(err) else ""
        return CodecPathChoice(CodecPath.EAGER, f"the {fast.value} path failed ({type(err).__name__}: {first_line})")
    warmup = time.perf_counter() - t0
    differs, eager_s, fast_s = _compare(plan, trainer, fast)
    if differs is not None:
        return CodecPathChoice(CodecPath.EAGER, f"the {fast.value} path's bytes differ from eager's in {differs}",
                               warmup, eager_s, fast_s)
    verdict = (f"the {fast.value} path is bit-identical to eager on every tensor of the model; quantizing took "
               f"{fast_s:.3f} s {fast.value} against {eager_s:.3f} s eager")
    if fast_s >= eager_s:
        return CodecPathChoice(CodecPath.EAGER, f"{verdict}: not faster", warmup, eager_s, fast_s)
    return CodecPathChoice(fast, verdict, warmup, eager_s, fast_s)
