"""The refit: engine-side results and the captured-storage fingerprint.

The refit session state machine (IDLE -> STAGING -> FINALIZING -> LIVE | FAILED) lives here too.
"""

from __future__ import annotations

import attrs
import torch


@attrs.frozen
class StorageRecord:
    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> StorageRecord:
        return cls(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


@attrs.frozen
class StorageFingerprint:
    """The identity of every captured live tensor, by name."""

    records: dict[str, StorageRecord]

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor]) -> StorageFingerprint:
        return cls({name: StorageRecord.of(t) for name, t in tensors.items()})

    def differences(self, after: StorageFingerprint) -> list[str]:
        """Names whose pointer, shape, stride or dtype changed, or that appeared or vanished."""
        names = sorted(set(self.records) | set(after.records))
        return [n for n in names if self.records.get(n) != after.records.get(n)]


@attrs.frozen
class EngineFinalizeResult:
    """What the engine reports after a successful finalize.

    Attributes:
        kv_scales_reset: attention layers whose q/k/v/prob scales were reset to 1.0.
        postprocess_seconds: time spent post-processing (run once per refit).
        tensors_committed: live tensors written by in-place copy.
    """

    kv_scales_reset: int = 0
    postprocess_seconds: float = 0.0
    tensors_committed: int = 0
