"""What a refit reports: the engine's finalize result, the outcome, the delta figures, the probe's
result and the whole measured report.

These are values only: the modules that measure them (domain.refit.delta_sync, domain.refit.probe)
and the errors that carry a report (domain.errors) import this module, never the reverse.
"""

from __future__ import annotations

import enum

import attrs
import torch

from domain.refit.storage import StorageCheck


@attrs.frozen
class DeltaReport:
    """The delta part of a refit's report.

    Attributes:
        mode: "full" or "delta".
        why_full: why the refit was full (None for a delta refit).
        wire_bytes: bytes of the tensors and records sent.
        full_bytes: bytes a full refit of the same weights sends.
        tensors_delta: tensors sent as delta records.
        tensors_whole: tensors sent whole.
        trainer_host_bytes: bytes of the trainer's copy after the refit.
        engine_host_bytes: bytes of the engine's copy after the refit.
        diff_seconds: trainer seconds spent diffing, hashing and keeping its copy.
        patch_seconds: engine seconds spent patching, hashing and keeping its copy.
    """

    mode: str
    why_full: str | None
    wire_bytes: int
    full_bytes: int
    tensors_delta: int
    tensors_whole: int
    trainer_host_bytes: int
    engine_host_bytes: int = 0
    diff_seconds: float = 0.0
    patch_seconds: float = 0.0

    @property
    def ratio(self) -> float:
        """Bytes sent over the bytes of a full refit."""
        return self.wire_bytes / self.full_bytes if self.full_bytes else 1.0

    def to_dict(self) -> dict[str, object]:
        return attrs.asdict(self) | {"ratio": self.ratio}


@attrs.frozen
class ProbeCheck:
    """One probe's result.

    Attributes:
        reference: what the engine was compared with, in words.
        bound: the max abs log-prob difference allowed.
        max_abs_diff: the largest difference seen (inf when shapes or finiteness differ).
        tokens: log-probs compared.
    """

    reference: str
    bound: float
    max_abs_diff: float
    tokens: int

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.bound

    @classmethod
    def compare(cls, engine: torch.Tensor, reference: torch.Tensor, *, bound: float, name: str) -> ProbeCheck:
        """Compare two [B, T-1] log-prob tensors (NaN or a shape mismatch counts as infinitely far)."""
        if engine.shape != reference.shape:
            return cls(name, bound, float("inf"), int(reference.numel()))
        e, r = engine.double(), reference.double()
        diff = (e - r).abs()
        same_inf = torch.isinf(e) & torch.isinf(r) & (torch.sign(e) == torch.sign(r))
        diff = torch.where(same_inf, torch.zeros_like(diff), diff)
        worst = float("inf") if bool(torch.isnan(diff).any()) else float(diff.max()) if diff.numel() else 0.0
        return cls(name, bound, worst, int(reference.numel()))

    def to_dict(self) -> dict[str, object]:
        return {"reference": self.reference, "bound": self.bound, "max_abs_diff": self.max_abs_diff,
                "tokens": self.tokens, "passed": self.passed}

    def __str__(self) -> str:
        if self.passed:
            return f"ok (max |dlogp| {self.max_abs_diff:.3g} <= {self.bound:g} vs {self.reference})"
        return f"FAILED (max |dlogp| {self.max_abs_diff:.3g} > {self.bound:g} vs {self.reference})"


@attrs.frozen
class EngineFinalizeResult:
    """What the engine reports after a successful finalize.

    Attributes:
        kv_scales_reset: attention layers whose q/k/v/prob scales were reset to 1.0.
        postprocess_seconds: time spent post-processing (run once per refit).
        tensors_committed: live tensors written by in-place copy.
        peak_staging_bytes: the most bytes the engine held staged at once during this refit.
        parameters_written: engine parameters the refit wrote (None: the engine does not count).
        unwritten: engine parameters it should have written and did not (they hold older weights).
    """

    kv_scales_reset: int = 0
    postprocess_seconds: float = 0.0
    tensors_committed: int = 0
    peak_staging_bytes: int = 0
    parameters_written: int | None = None
    unwritten: tuple[str, ...] = ()


class RefitOutcome(enum.Enum):
    LIVE = "live"  # committed and verified
    ROLLED_BACK = "rolled-back"  # failed; live weights are the previous refit's, bit for bit
    STALE = "stale"  # failed after live weights were touched; the engine refuses to serve




@attrs.frozen
class RefitReport:
    """Everything one refit did, measured.

    Attributes:
        refit_id: the refit's id.
        outcome: LIVE, ROLLED_BACK or STALE.
        plan: the quantization plan, in words (e.g. "linear=FP8_BLOCK moe=NVFP4").
        commit_mode: the engine's commit mode, when it reports one.
        source_bytes: bytes of the trainer's weights (BF16) that went into the refit.
        bytes_sent: bytes of checkpoint-format tensors sent (bucket payloads).
        buckets: buckets sent (a failed refit counts those sent before the failure).
        tensors: checkpoint-format tensors sent.
        timings: seconds per phase: export, quantize, pack, load, finalize, verify, total.
        peak_staging_bytes: most bytes the engine held staged at once.
        bucket_bytes: the bucket capacity used.
        storage: the captured-storage check.
        kv_scales_reset: attention layers whose KV-cache scales were reset to 1.0.
        error: the failure, in words (None when LIVE).
        parameters_written: engine parameters the refit wrote (None: the engine does not count).
        unwritten: engine parameters it left unwritten (a refit with any fails: RefitIncomplete).
        probe: the post-refit verification (None when not run).
        engine_state: what this side's engine holds afterwards: `live`, `kept` (its previous
            weights, untouched), `restored` (its previous weights, replayed), `stale`, or `-` (no
            engine on this side).
        delta: a `layout_delta` refit's figures: full or delta and why, bytes sent against a full
            refit's, both sides' host copies (None for other backends).
        codec_path: the path the codecs quantized with: `eager` (the reference), `native` or
            `compiled` (the fast paths, bit-identical on this machine); None: not reported.
    """

    refit_id: int
    outcome: RefitOutcome
    plan: str
    commit_mode: str | None
    source_bytes: int
    bytes_sent: int
    buckets: int
    tensors: int
    timings: dict[str, float]
    peak_staging_bytes: int
    bucket_bytes: int
    storage: StorageCheck
    kv_scales_reset: int = 0
    error: str | None = None
    parameters_written: int | None = None
    unwritten: tuple[str, ...] = ()
    probe: ProbeCheck | None = None
    engine_state: str = "-"
    delta: DeltaReport | None = None
    codec_path: str | None = None

    @property
    def ok(self) -> bool:
        return self.outcome is RefitOutcome.LIVE

    @property
    def throughput_gbps(self) -> float:
        """GB (1e9 bytes) of source (BF16) weights refitted per second of total time."""
        total = self.timings.get("total", 0.0)
        return self.source_bytes / total / 1e9 if total > 0 else 0.0

    def log_fields(self) -> dict[str, object]:
        """The fields of the canonical log line of this refit."""
        return {
            "refit_id": self.refit_id, "outcome": self.outcome.value, "commit_mode": self.commit_mode,
            "buckets": self.buckets, "tensors": self.tensors, "mb_sent": round(self.bytes_sent / 2**20, 3),
            "mb_source": round(self.source_bytes / 2**20, 3), "seconds": round(self.timings.get("total", 0.0), 4),
            "gbps": round(self.throughput_gbps, 4), "peak_staging_mb": round(self.peak_staging_bytes / 2**20, 3),
            "storage": str(self.storage), "kv_scales_reset": self.kv_scales_reset, "error": self.error,
            "parameters_written": self.parameters_written, "unwritten": len(self.unwritten),
            "probe": str(self.probe) if self.probe is not None else None, "codec_path": self.codec_path,
        } | (_delta_fields(self.delta) if self.delta is not None else {})

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dictionary."""
        d = attrs.asdict(self, recurse=False)
        d["outcome"] = self.outcome.value
        d["storage"] = {"checked": self.storage.checked, "ok": self.storage.ok, "changed": list(self.storage.changed)}
        d["unwritten"] = list(self.unwritten)
        d["probe"] = self.probe.to_dict() if self.probe is not None else None
        d["delta"] = self.delta.to_dict() if self.delta is not None else None
        d["throughput_gbps"] = self.throughput_gbps
        return d


def _delta_fields(d: DeltaReport) -> dict[str, object]:
    return {"delta_mode": d.mode, "why_full": d.why_full, "mb_wire": round(d.wire_bytes / 2**20, 3),
            "mb_full": round(d.full_bytes / 2**20, 3), "trainer_copy_mb": round(d.trainer_host_bytes / 2**20, 3),
            "engine_copy_mb": round(d.engine_host_bytes / 2**20, 3)}
