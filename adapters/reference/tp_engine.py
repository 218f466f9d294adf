"""The reference engine sharded over its own tensor-parallel ranks, as vLLM's workers are.

`TensorParallelEngine(config, plan, tp, rank)` is one engine rank: it receives the refit's full
stream (every engine rank receives every bucket) and keeps only its share of each tensor
(`domain.refit.engine_shard`: column-parallel weights by rows, row-parallel ones by columns,
quantized tensors block by block), in a ReferenceEngine of the rank's shapes (1/tp of the heads,
of the MLP and expert widths, of the vocabulary). Staging, verification, the commit and a
failed refit's rollback or stale mark are that engine's own.

To serve, the ranks need each other: `gather` (a collective over the engine's ranks) hands every
rank's shares to each rank, which puts the full tensors together and scores with the full model.
That is a reference, not a fast path; what it shows is that the shares are exactly the full
engine's weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from adapters.reference.config import ReferenceModelConfig, hf_weight_shapes
from adapters.reference.engine import ReferenceEngine
from adapters.reference.layout import GLOBAL, EngineLayout
from domain.errors import EngineTensorMismatch, ShardingError
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import checkpoint_names
from domain.refit.buckets import DEFAULT_ALIGNMENT, Bucket, TensorMeta, align_up, unpack_bucket
from domain.refit.engine_shard import engine_shard, engine_split_dim
from domain.refit.report import EngineFinalizeResult
from domain.refit.session import CommitMode
from domain.refit.storage import StorageFingerprint

# Every rank's shares (checkpoint name -> tensor), from this rank's: a collective over the engine's ranks.
Gather = Callable[[Mapping[str, torch.Tensor]], Sequence[Mapping[str, torch.Tensor]]]


def shard_config(cfg: ReferenceModelConfig, tp: int) -> ReferenceModelConfig:
    """The shapes one of `tp` engine ranks holds.

    Raises:
        ShardingError: tp does not divide the heads, the key/value heads, the MLP or expert
            width or the vocabulary.
    """
    sizes = {"vocab_size": cfg.vocab_size, "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
             "intermediate_size": cfg.intermediate_size, "moe_intermediate_size": cfg.moe_intermediate_size}
    bad = [f"{k}={v}" for k, v in sizes.items() if v % tp]
    if bad:
        raise ShardingError("engine tensor_parallel_size", f"tp={tp} does not divide {', '.join(bad)}; use a divisor")
    shares: dict[str, Any] = {k: v // tp for k, v in sizes.items()}
    return attrs.evolve(cfg, **shares)


def _commit_mode(value: str | CommitMode) -> CommitMode:
    return CommitMode.parse(value)


def _sources(cfg: ReferenceModelConfig, plan: QuantizationPlan) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """Checkpoint name -> (its local name, the HF tensor it encodes, that tensor's full shape)."""
    out = {}
    for name, shape in hf_weight_shapes(cfg):
        d = plan.decide(name, shape)
        for full in checkpoint_names(plan, d, shape):
            local = full.rsplit(".", 1)[-1] if d.is_quantized else "weight"
            out[full] = (local, name, shape)
    return out


@attrs.define
class TensorParallelEngine:
    """A RolloutEngine: rank `rank` of the reference engine sharded over `tp` ranks.

    Attributes:
        config: the full model's shapes.
        plan: the rollout plan.
        tp: the engine's tensor-parallel size.
        rank: this engine rank, in [0, tp).
        commit_mode: transactional or per-layer (the inner engine's).
        gather: every rank's shares from this rank's (for serving); None: this rank cannot serve.
        inner: the ReferenceEngine of this rank's shapes (its live weights are the shares).
    """

    config: ReferenceModelConfig
    plan: QuantizationPlan
    tp: int
    rank: int
    commit_mode: CommitMode = attrs.field(default=CommitMode.TRANSACTIONAL, converter=_commit_mode)
    gather: Gather | None = None
    inner: ReferenceEngine = attrs.field(init=False)
    _sources: dict[str, tuple[str, str, tuple[int, ...]]] = attrs.field(init=False)
    _serving: ReferenceEngine | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.rank < self.tp:
            raise ShardingError("engine rank", f"{self.rank} is outside [0, {self.tp})")
        self.inner = ReferenceEngine(shard_config(self.config, self.tp), self.plan, commit_mode=self.commit_mode)
        self._sources = _sources(self.config, self.plan)
        full = EngineLayout.build(self.config, self.plan)
        for name, (local, hf, shape) in self._sources.items():  # every share divides, or say which does not
            engine_shard(local, torch.empty(full.targets[name].shape, device="meta"), hf, shape, self.tp, 0)

    # --- the port --------------------------------------------------------------------------------

    @property
    def verifiers(self) -> list[Any]:
        """The inner engine's extra checks (run on the rank's shares before they are committed)."""
        return self.inner.verifiers

    @property
    def is_stale(self) -> bool:
        return self.inner.is_stale

    def live_weights(self) -> Mapping[str, torch.Tensor]:
        """This rank's live shares, by the engine's own names."""
        return self.inner.live_weights()

    def storage_fingerprint(self) -> StorageFingerprint:
        return self.inner.storage_fingerprint()

    def begin_refit(self, refit_id: int) -> None:
        self.inner.begin_refit(refit_id)

    def load_bucket(self, bucket: Bucket) -> None:
        """Keep this rank's share of every tensor of a bucket of the full stream."""
        names, shares = [], []
        for name, view in unpack_bucket(bucket):
            source = self._sources.get(name)
            if source is None:
                raise EngineTensorMismatch(f"tensor {name!r} has no place in the engine; check the plan")
            local, hf, shape = source
            names.append(name)
            shares.append(engine_shard(local, view, hf, shape, self.tp, self.rank).contiguous())
        self.inner.load_bucket(_by_reference(bucket, names, shares))

    def finalize_refit(self) -> EngineFinalizeResult:
        result = self.inner.finalize_refit()
        self._serving = None
        return result

    def abort_refit(self, reason: str) -> None:
        self.inner.abort_refit(reason)

    def mark_stale(self, reason: str) -> None:
        self.inner.mark_stale(reason)

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Score with the full model, put together from every rank's shares (collective: every
        rank of the engine calls it)."""
        if self.gather is None:
            raise ShardingError("engine gather", "a tensor-parallel engine rank serves with its peers; build it "
                                "with gather= (a collective over the engine's ranks)")
        self.inner.log_probs(torch.zeros(1, 2, dtype=torch.int64))  # the rank's own refusal: stale, or busy
        everyone = self.gather(self.shares())
        if self._serving is None:
            self._serving = unshard(self.config, self.plan, everyone)
        return self._serving.log_probs(input_ids, temperature=temperature)

    # --- shares ----------------------------------------------------------------------------------

    def shares(self) -> dict[str, torch.Tensor]:
        """This rank's live share of every checkpoint tensor, by checkpoint name."""
        live = self.inner.live_weights()
        out = {}
        for name, t in self.inner.layout.targets.items():
            index = t.index if t.local != GLOBAL else (*t.index[:-1], slice(0, 1))  # the committed maximum
            out[name] = live[f"{t.key}.{t.local}"][index]
        return out


def unshard(config: ReferenceModelConfig, plan: QuantizationPlan,
            shares: Sequence[Mapping[str, torch.Tensor]]) -> ReferenceEngine:
    """A full ReferenceEngine holding the tensors that every rank's shares make up.

    Args:
        config: the full model's shapes.
        plan: the rollout plan.
        shares: each rank's `shares()`, by rank.

    Returns:
        The engine, committed.
    """
    names, tensors = [], []
    for name, (local, hf, shape) in _sources(config, plan).items():
        dim = engine_split_dim(hf, shape)
        parts = [s[name] for s in shares]
        names.append(name)
        whole = parts[0] if dim is None or local == GLOBAL or len(parts) == 1 else torch.cat(parts, dim=dim)
        tensors.append(whole.contiguous())
    engine = ReferenceEngine(config, plan)
    engine.begin_refit(1)
    engine.load_bucket(_by_reference(Bucket(0, torch.empty(0, dtype=torch.uint8), (), True), names, tensors))
    engine.finalize_refit()
    return engine


def _by_reference(like: Bucket, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> Bucket:
    """A bucket by reference with `like`'s index and last flag."""
    metas, end = [], 0
    for name, t in zip(names, tensors, strict=True):
        offset = align_up(end, DEFAULT_ALIGNMENT)
        metas.append(TensorMeta(name, tuple(t.shape), t.dtype, offset, t.numel() * t.element_size()))
        end = offset + t.numel() * t.element_size()
    return Bucket(like.index, torch.empty(0, dtype=torch.uint8), tuple(metas), like.is_last, tensors=tuple(tensors))
