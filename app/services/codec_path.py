"""Which codec path a refit quantizes with: the compiled fast path where it is bit-identical and
faster on this machine, else the eager reference (docs/refit.md#the-codec-path).

The choice is made once per RefitService, before its first refit and outside its timings: the
compiled path quantizes the trainer's weights once (that compiles one kernel per format, rule,
dtype and row length of the model: the warm-up), then both paths quantize them again, in turns
tensor by tensor, and every output is compared byte for byte. The compiled path is chosen when
every byte is equal and it took less time; otherwise the refit stays eager and says why.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

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
        path: eager or compiled.
        reason: why, in words.
        warmup_seconds: the compiled path's first pass over the model (compiling), 0 when not tried.
        eager_seconds: quantizing the model eagerly, in the comparison (0 when not compared).
        compiled_seconds: quantizing it compiled, warm, in the comparison (0 when not compared).
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


def _compare(plan: QuantizationPlan, trainer: TrainerModel) -> tuple[str | None, float, float]:
    """Both paths over the model, in turns tensor by tensor: the first tensor whose bytes differ
    (None: none), and each path's seconds."""
    times = {CodecPath.EAGER: 0.0, CodecPath.COMPILED: 0.0}
    streams = {path: on_path(path, quantize_stream(plan, trainer.named_weights())) for path in times}
    while True:
        out = {}
        for path, stream in streams.items():
            t0 = time.perf_counter()
            out[path] = next(stream, None)
            times[path] += time.perf_counter() - t0
        eager, compiled = out[CodecPath.EAGER], out[CodecPath.COMPILED]
        if eager is None or compiled is None:
            if eager is not compiled:
                return "the two paths yielded different numbers of tensors", times[CodecPath.EAGER], 0.0
            return None, times[CodecPath.EAGER], times[CodecPath.COMPILED]
        (name, a), (other, b) = eager, compiled
        if name != other or a.dtype != b.dtype or a.shape != b.shape or not torch.equal(
                a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)):
            return name, times[CodecPath.EAGER], times[CodecPath.COMPILED]


def choose_codec_path(plan: QuantizationPlan, trainer: TrainerModel, policy: str = "auto",
                      *, min_bytes: int | None = None) -> CodecPathChoice:
    """Choose the path a refit of `trainer` under `plan` quantizes with.

    Args:
        plan: the rollout plan.
        trainer: the trainer whose weights are refitted.
        policy: auto (the compiled path where it is bit-identical and faster) or eager.
        min_bytes: auto keeps a model with fewer bytes to quantize eager, untried (None:
            AUTO_MIN_BYTES).

    Returns:
        The choice; compiling that fails (no C++ compiler, an unsupported torch) gives eager with
        the error as the reason.
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
    t0 = time.perf_counter()
    try:
        for _ in on_path(CodecPath.COMPILED, quantize_stream(plan, trainer.named_weights())):
            pass
    except Exception as err:  # compiling is optional: any failure leaves the reference path
        structlog.get_logger().warning("the compiled codec path is unavailable; quantizing eagerly",
                                       error=f"{type(err).__name__}: {err}")
        first_line = str(err).splitlines()[0][:200] if str(err) else ""
        return CodecPathChoice(CodecPath.EAGER, f"compiling failed ({type(err).__name__}: {first_line})")
    warmup = time.perf_counter() - t0
    differs, eager_s, compiled_s = _compare(plan, trainer)
    if differs is not None:
        return CodecPathChoice(CodecPath.EAGER, f"the compiled path's bytes differ from eager's in {differs}",
                               warmup, eager_s, compiled_s)
    verdict = (f"bit-identical to eager on every tensor of the model; quantizing took {compiled_s:.3f} s compiled "
               f"against {eager_s:.3f} s eager")
    if compiled_s >= eager_s:
        return CodecPathChoice(CodecPath.EAGER, f"the compiled path is {verdict}: not faster", warmup, eager_s,
                               compiled_s)
    return CodecPathChoice(CodecPath.COMPILED, verdict, warmup, eager_s, compiled_s)
