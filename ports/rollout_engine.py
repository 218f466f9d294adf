"""Port: a rollout engine whose weights a refit replaces."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch

from domain.refit.buckets import Bucket
from domain.refit.report import EngineFinalizeResult
from domain.refit.session import CommitMode
from domain.refit.storage import StorageFingerprint


class RolloutEngine(Protocol):
    """The engine side of a refit. Only the application service drives it.

    Lifecycle (docs/refit.md#the-lifecycle): begin_refit, load_bucket for buckets 0..n in order
    (the last marked `is_last`), finalize_refit once; abort_refit on any failure. Out-of-order,
    duplicate or late buckets raise BucketSequenceError; a finalize before the last bucket raises
    BucketSequenceError; a second finalize or a begin during a refit raises RefitLifecycleError.
    """

    @property
    def commit_mode(self) -> CommitMode:
        """How the engine commits staged weights (its guarantee on failure)."""
        ...

    def begin_refit(self, refit_id: int) -> None:
        """Open a refit: the engine prepares to stage buckets and stops serving until finalize.

        Args:
            refit_id: the caller's id for this refit, echoed in errors.
        """
        ...

    def load_bucket(self, bucket: Bucket) -> None:
        """Stage one bucket. Returns only after the bucket's bytes are copied or consumed, so the
        sender may reuse its buffer as soon as this returns (the acknowledgement). When
        `bucket.retained` is True the buffer stays valid until the refit is finalized or aborted,
        and the engine may keep views of it instead of copying (stage by reference)."""
        ...

    def finalize_refit(self) -> EngineFinalizeResult:
        """After the last bucket: post-process once, commit into live storage in place, reset
        uncalibrated KV-cache scales. Raises on failure, leaving live weights per the commit mode."""
        ...

    def abort_refit(self, reason: str) -> None:
        """Drop staged state. Live weights stay as they were (transactional) or the engine is
        marked stale (per-layer). A no-op when no refit is in progress."""
        ...

    def mark_stale(self, reason: str) -> None:
        """Refuse to serve until a full refit succeeds (the caller's checks failed after commit,
        e.g. captured storage was rebound)."""
        ...

    def storage_fingerprint(self) -> StorageFingerprint:
        """Data pointer, shape, stride and dtype of every captured live tensor."""
        ...

    @property
    def is_stale(self) -> bool:
        """True when live weights are not a complete refit; a stale engine refuses to serve."""
        ...

    def log_probs(
        self, input_ids: torch.Tensor, *, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rollout-side log-probs and entropy, same contract as TrainerModel.log_probs.

        Raises EngineBusy while a refit is in progress and EngineStale while stale.
        """
        ...

    def live_weights(self) -> Mapping[str, torch.Tensor]:
        """The live (captured) tensors by the engine's own names, exactly the ones the storage
        fingerprint covers (read-only use: tests, checks, probes)."""
        ...


@runtime_checkable
class UndoableEngine(Protocol):
    """An engine that keeps its previous weights after a refit commits, until the next one: a
    committed refit the trainer then refuses (the probe, the audit) is undone from that backup
    instead of leaving the engine stale (an attached vLLM server's rl_refit backend)."""

    def undo_commit(self, reason: str) -> bool:
        """Put the previous weights back; True when they are, False when the engine could not
        (it is then stale)."""
        ...
