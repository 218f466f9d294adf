"""A wrapper that makes any engine fail at a scripted point of the refit lifecycle."""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from adapters.memory.faults import FaultPoint, FaultScript
from domain.errors import InjectedFault
from domain.refit.buckets import Bucket
from domain.refit.report import EngineFinalizeResult
from domain.refit.session import CommitMode
from domain.refit.storage import StorageFingerprint
from ports.rollout_engine import RolloutEngine


@attrs.define
class ScriptedFaultyEngine:
    """Delegates to `inner`, failing as `script` says for its first `script.refits` refits.

    - bucket:K: loading bucket K raises InjectedFault before the inner engine sees it (a transport
      failure); the inner engine has staged buckets 0..K-1.
    - finalize: finalize raises InjectedFault before the inner engine post-processes (a crash in
      post-processing).
    - verify: a failing verifier is added to the inner engine's `verifiers` for the refit, so the
      inner engine's own verification step fails (before its commit in transactional mode).

    Attributes:
        inner: the engine that does the work.
        script: where to fail, and which refits (`after`, `refits`).
        fired: how many refits this wrapper has failed so far.
        begun: how many refits have begun through it.
    """

    inner: RolloutEngine
    script: FaultScript
    fired: int = 0
    begun: int = 0
    _armed: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        if self.script.point is FaultPoint.VERIFY and not isinstance(getattr(self.inner, "verifiers", None), list):
            raise TypeError(
                f"{type(self.inner).__name__} has no `verifiers` list; a verify fault needs one "
                "(use bucket:K or finalize instead)"
            )

    @property
    def commit_mode(self) -> CommitMode:
        return self.inner.commit_mode

    @property
    def is_stale(self) -> bool:
        return self.inner.is_stale

    def _fire(self, what: str) -> InjectedFault:
        self._armed = False
        self.fired += 1
        self._disarm_verifier()
        return InjectedFault(f"injected fault ({self.script}): {what}")

    def _verifier(self, group: str, staged: Mapping[str, torch.Tensor]) -> None:
        raise self._fire(f"verification of {group!r} rejected the staged weights")

    def _disarm_verifier(self) -> None:
        verifiers = getattr(self.inner, "verifiers", None)
        if isinstance(verifiers, list) and self._verifier in verifiers:
            verifiers.remove(self._verifier)

    def begin_refit(self, refit_id: int) -> None:
        self.inner.begin_refit(refit_id)
        self._armed = self.script.fails(self.begun)
        self.begun += 1
        if self._armed and self.script.point is FaultPoint.VERIFY:
            self.inner.verifiers.append(self._verifier)  # type: ignore[attr-defined]

    def load_bucket(self, bucket: Bucket) -> None:
        if self._armed and self.script.point is FaultPoint.BUCKET and bucket.index == self.script.bucket_index:
            raise self._fire(f"bucket {bucket.index} was lost in transport")
        self.inner.load_bucket(bucket)

    def finalize_refit(self) -> EngineFinalizeResult:
        if self._armed and self.script.point is FaultPoint.FINALIZE:
            raise self._fire("post-processing crashed")
        try:
            return self.inner.finalize_refit()
        finally:
            self._disarm_verifier()

    def abort_refit(self, reason: str) -> None:
        self._disarm_verifier()
        self.inner.abort_refit(reason)

    def mark_stale(self, reason: str) -> None:
        self.inner.mark_stale(reason)

    def storage_fingerprint(self) -> StorageFingerprint:
        return self.inner.storage_fingerprint()

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.log_probs(input_ids, temperature=temperature)

    def live_weights(self) -> Mapping[str, torch.Tensor]:
        return self.inner.live_weights()
