"""ReplicatedEngine: several rollout engine replicas (data-parallel rollout) refitted by one refit,
all or nothing.

One RefitService drives the replicas as one RolloutEngine: each bucket is loaded into every
replica in turn (the sender may reuse its buffer once the last replica took it), and the refit is
live only when every replica finalized. When any replica fails, every replica ends the refit the
same way: none serves the new weights while another serves the old ones. A failure before any
replica committed or went stale aborts them all (a transactional replica keeps its weights); a
failure after a replica committed, or that left one stale, marks every replica stale, so the commit mode of a group of replicas is
PER_LAYER whatever the replicas' own: a replica that committed cannot be rolled back by the group.
With `rollout.checkpoint_engine.restore: replay` the previous refit's buckets are streamed into
every replica again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch

from domain.errors import ConfigError
from domain.refit.buckets import Bucket
from domain.refit.report import EngineFinalizeResult
from domain.refit.session import CommitMode
from domain.refit.storage import StorageFingerprint
from ports.rollout_engine import RolloutEngine


@attrs.define
class ReplicatedEngine:
    """A RolloutEngine over `replicas` (two or more), refitted together.

    Attributes:
        replicas: the engines; replica 0 serves `log_probs` (each replica serves its own rollouts
            through its own handle).
    """

    replicas: Sequence[RolloutEngine]
    _begun: list[RolloutEngine] = attrs.field(init=False, factory=list)
    _committed: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        if len(self.replicas) < 2:
            raise ConfigError("rollout.replicas", f"a replicated engine needs two replicas or more, got {len(self.replicas)}")

    @property
    def commit_mode(self) -> CommitMode:
        return CommitMode.PER_LAYER  # a replica that committed is not rolled back when another fails

    @property
    def is_stale(self) -> bool:
        return any(r.is_stale for r in self.replicas)

    def begin_refit(self, refit_id: int) -> None:
        self._begun, self._committed = [], 0
        for i, replica in enumerate(self.replicas):
            try:
                replica.begin_refit(refit_id)
            except Exception as err:  # the replicas that opened the refit drop it: none has loaded anything
                for begun in self._begun:
                    begun.abort_refit(f"replica {i} could not open refit {refit_id}: {type(err).__name__}: {err}")
                raise
            self._begun.append(replica)

    def load_bucket(self, bucket: Bucket) -> None:
        for replica in self.replicas:
            replica.load_bucket(bucket)

    def finalize_refit(self) -> EngineFinalizeResult:
        results = []
        for i, replica in enumerate(self.replicas):
            try:
                results.append(replica.finalize_refit())
            except Exception as err:
                self._fail_others(i, f"replica {i} failed to finalize ({type(err).__name__}: {err})")
                raise
            self._committed += 1
        first = results[0]
        unwritten = tuple(sorted({f"replica{i}/{n}" for i, r in enumerate(results) for n in r.unwritten}))
        counts = [r.parameters_written for r in results]
        return EngineFinalizeResult(
            kv_scales_reset=sum(r.kv_scales_reset for r in results),
            postprocess_seconds=sum(r.postprocess_seconds for r in results),
            tensors_committed=sum(r.tensors_committed for r in results),
            peak_staging_bytes=max(r.peak_staging_bytes for r in results),
            parameters_written=None if any(c is None for c in counts) else sum(c for c in counts if c is not None),
            unwritten=unwritten if len(unwritten) else first.unwritten)

    def _fail_others(self, failed: int, reason: str) -> None:
        """Replica `failed` raised in finalize: the ones after it abort; when replicas before it
        committed, every replica is marked stale (no replica serves weights the others lack)."""
        for other in self.replicas[failed + 1:]:
            other.abort_refit(reason)
        if self._committed:
            self.mark_stale(f"{reason}; replicas serve the same weights or none")

    def abort_refit(self, reason: str) -> None:
        for replica in self.replicas:
            replica.abort_refit(reason)
        if self._committed or self.is_stale:  # a replica holds new or broken weights: none serves
            self.mark_stale(f"{reason}; replicas serve the same weights or none")

    def mark_stale(self, reason: str) -> None:
        for replica in self.replicas:
            replica.mark_stale(reason)

    def storage_fingerprint(self) -> StorageFingerprint:
        return StorageFingerprint({f"replica{i}/{name}": rec for i, r in enumerate(self.replicas)
                                   for name, rec in r.storage_fingerprint().records.items()})

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        return self.replicas[0].log_probs(input_ids, temperature=temperature)

    def live_weights(self) -> Mapping[str, torch.Tensor]:
        return {f"replica{i}/{name}": t for i, r in enumerate(self.replicas) for name, t in r.live_weights().items()}

    def close(self) -> None:
        """Close every replica that can be closed."""
        errors: list[BaseException] = []
        for replica in self.replicas:
            close: Any = getattr(replica, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as err:  # close the others first
                    errors.append(err)
        if errors:
            raise errors[0]
