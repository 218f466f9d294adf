"""What the ranks of a distributed refit tell each other: their roles, rank statuses, engine states,
stream stats.

At each agreement point every rank contributes one RankStatus, so all ranks learn who failed,
where, and why. These are plain values; how they travel is the transport adapter's business.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs


class Role(enum.StrEnum):
    """What a rank of a refit world does."""

    TRAINER = "trainer"
    ENGINE = "engine"


@attrs.frozen
class TransferStats:
    """What one side of a bucket stream did.

    Attributes:
        buckets: buckets sent or received.
        payload_bytes: bytes of tensor data in them.
        wire_bytes: bytes of buffers moved (padding included).
        seconds: wall time of the whole send / receive.
        blocked_seconds: time spent waiting on the peer (collectives, acknowledgements).
        consume_seconds: receiver: time inside the consumer (engine load).
    """

    buckets: int = 0
    payload_bytes: int = 0
    wire_bytes: int = 0
    seconds: float = 0.0
    blocked_seconds: float = 0.0
    consume_seconds: float = 0.0


class EngineState(enum.Enum):
    NONE = "-"  # trainer ranks; engines before finalize
    COMMITTED = "committed"  # finalized and storage-checked, awaiting the world's verdict
    LIVE = "live"  # the refit is live
    KEPT = "kept"  # the refit was aborted before the engine touched its live weights
    RESTORED = "restored"  # the engine had committed; its previous weights were replayed, bit for bit
    STALE = "stale"  # the engine refuses to serve until a full refit succeeds


@attrs.frozen
class RankStatus:
    """One rank's word at an agreement point.

    Attributes:
        rank: the rank.
        role: `trainer` or `engine`.
        ok: False when this rank failed.
        step: where it failed (e.g. `bucket 3`, `export model.layers.0.self_attn.qkv`).
        error: the error, in words (truncated to fit the record).
        engine: an engine's state.
        fingerprint: at the first agreement, what this rank believes the refit is (id, plan,
            layout, model), so that ranks configured differently fail before anything moves.
    """

    rank: int
    role: Role = attrs.field(converter=Role)
    ok: bool = True
    step: str = ""
    error: str = ""
    engine: EngineState = EngineState.NONE
    fingerprint: str = ""

    def failed(self, step: str, err: BaseException | str) -> RankStatus:
        """This status, failed at `step` with `err` (the first failure is kept)."""
        if not self.ok:
            return self
        text = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
        return attrs.evolve(self, ok=False, step=step, error=text)


def failure_summary(refit_id: int, statuses: Sequence[RankStatus]) -> str:
    """The one message every rank raises for a failed refit: who failed where, what engines did.

    Args:
        refit_id: the refit.
        statuses: every rank's final status, by rank.

    Returns:
        e.g. `refit 3 failed: rank 2 (engine) at bucket 1: InjectedFault: ...; engines: rank 2
        kept, rank 3 restored`. Ranks that only saw a peer's failure are not listed as causes.
    """
    failed = [s for s in statuses if not s.ok]
    causes = [s for s in failed if not s.error.startswith(("PeerFailed", "TransportAborted"))] or failed
    what = "; ".join(f"rank {s.rank} ({s.role}) at {s.step}: {s.error}" for s in causes) or "unknown cause"
    engines = ", ".join(f"rank {s.rank} {s.engine.value}" for s in statuses if s.role == "engine")
    return f"refit {refit_id} failed: {what}; engines: {engines}"
