"""A transactional in-memory engine that stores exactly what a refit sends, and records it."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType

import attrs
import torch

from domain.errors import EngineTensorMismatch, RefitVerificationFailed
from domain.refit.buckets import Bucket, unpack_bucket
from domain.refit.guard import EngineGuard
from domain.refit.report import EngineFinalizeResult
from domain.refit.session import CommitMode
from domain.refit.storage import StorageFingerprint

Layout = Mapping[str, tuple[tuple[int, ...], torch.dtype]]
Verifier = Callable[[str, Mapping[str, torch.Tensor]], None]


@attrs.define
class RecordingEngine:
    """A RolloutEngine holding one live tensor per checkpoint name, allocated up front.

    It serves a uniform next-token distribution over `vocab_size` tokens (it has no model), so
    that probes and contract tests can run against it.

    Attributes:
        layout: checkpoint name -> (shape, dtype) of every tensor a refit must deliver.
        vocab_size: size of the uniform distribution it serves.
        verifiers: checks run on the staged tensors (group "all") before they are committed.
        events: every call, in order: ("begin", id), ("bucket", index, names), ("finalize", id),
            ("abort", reason), ("stale", reason).
    """

    layout: Layout
    vocab_size: int = 32
    verifiers: list[Verifier] = attrs.field(factory=list)
    events: list[tuple[object, ...]] = attrs.field(factory=list)
    _live: dict[str, torch.Tensor] = attrs.field(init=False)
    _staged: dict[str, torch.Tensor] = attrs.field(init=False, factory=dict)
    commit_mode: CommitMode = attrs.field(init=False, default=CommitMode.TRANSACTIONAL)
    _guard: EngineGuard = attrs.field(init=False)
    _peak: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._guard = EngineGuard(on_fail=self._dropped)
        self._live = {n: torch.zeros(shape, dtype=dtype) for n, (shape, dtype) in self.layout.items()}

    @classmethod
    def for_stream(cls, named_tensors: Iterable[tuple[str, torch.Tensor]], **kwargs: object) -> RecordingEngine:
        """An engine whose layout is the names, shapes and dtypes of a sample refit stream."""
        return cls({n: (tuple(t.shape), t.dtype) for n, t in named_tensors}, **kwargs)  # type: ignore[arg-type]

    @property
    def is_stale(self) -> bool:
        return self._guard.is_stale

    def finalize_count(self, refit_id: int) -> int:
        """How many times refit `refit_id` was finalized (post-processed)."""
        return sum(1 for e in self.events if e == ("finalize", refit_id))

    def live_weights(self) -> Mapping[str, torch.Tensor]:
        return MappingProxyType(self._live)

    def storage_fingerprint(self) -> StorageFingerprint:
        return StorageFingerprint.of(dict(self._live))

    def begin_refit(self, refit_id: int) -> None:
        self._guard.begin(refit_id)
        self._staged = {}
        self._peak = 0
        self.events.append(("begin", refit_id))

    def load_bucket(self, bucket: Bucket) -> None:
        self._guard.accept(bucket)
        self.events.append(("bucket", bucket.index, tuple(m.name for m in bucket.metas)))
        try:
            for name, view in unpack_bucket(bucket):
                self._stage(name, view)
        except Exception as err:
            self.abort_refit(f"loading bucket {bucket.index}: {err}")
            raise

    def _stage(self, name: str, view: torch.Tensor) -> None:
        if name not in self.layout:
            raise EngineTensorMismatch(f"tensor {name!r} has no place in the engine")
        if name in self._staged:
            raise EngineTensorMismatch(f"tensor {name!r} arrived twice in one refit")
        shape, dtype = self.layout[name]
        if tuple(view.shape) != tuple(shape) or view.dtype != dtype:
            raise EngineTensorMismatch(
                f"tensor {name!r}: got {view.dtype} {tuple(view.shape)}, expected {dtype} {tuple(shape)}"
            )
        self._staged[name] = view.clone()  # copied before the bucket is acknowledged
        self._peak = max(self._peak, sum(t.numel() * t.element_size() for t in self._staged.values()))

    def finalize_refit(self) -> EngineFinalizeResult:
        self._guard.finalize()
        self.events.append(("finalize", self._guard.refit_id))
        try:
            missing = sorted(set(self.layout) - set(self._staged))
            if missing:
                raise RefitVerificationFailed(f"{len(missing)} tensors never arrived, e.g. {missing[:3]}")
            for verify in self.verifiers:
                verify("all", MappingProxyType(self._staged))
        except Exception as err:
            self.abort_refit(f"finalize: {err}")
            raise
        for name, t in self._staged.items():
            self._commit_one(name, t)
        count = len(self._staged)
        self._staged = {}
        self._guard.commit()
        return EngineFinalizeResult(tensors_committed=count, peak_staging_bytes=self._peak)

    def _commit_one(self, name: str, staged: torch.Tensor) -> None:
        self._live[name].copy_(staged)

    def _dropped(self, reason: str) -> None:
        self._staged = {}
        self.events.append(("abort", reason))

    def abort_refit(self, reason: str) -> None:
        self._guard.abort(reason)

    def mark_stale(self, reason: str) -> None:
        self._guard.mark_stale(reason)
        self.events.append(("stale", reason))

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """A uniform distribution over `vocab_size` tokens: log p = -log V, entropy = log V."""
        self._guard.check_serving()
        if input_ids.dim() != 2 or input_ids.shape[1] < 2:
            raise ValueError(f"input_ids must be [B, T] with T >= 2, got {tuple(input_ids.shape)}")
        shape = (input_ids.shape[0], input_ids.shape[1] - 1)
        logv = math.log(self.vocab_size)
        return torch.full(shape, -logv), torch.full(shape, logv)


@attrs.define
class RebindingEngine(RecordingEngine):
    """A faulty engine on purpose: its commit replaces live tensors instead of copying into them
    (what `param.data = new` does), which breaks CUDA-graph-captured storage."""

    def _commit_one(self, name: str, staged: torch.Tensor) -> None:
        self._live[name] = staged.clone()
