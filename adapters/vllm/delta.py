"""Delta refits on vLLM: the workers' receiver state as plain values, and one view over all workers.

Each vLLM worker keeps its own DeltaReceiver (WorkerRefit.delta): every worker loads the whole
checkpoint-format stream, so each holds a copy. The trainer may send a delta only when every
worker holds the same copy; any disagreement reads as "no base" (a full refit).
"""

from __future__ import annotations

from collections.abc import Sequence

from domain.refit.delta_sync import DeltaBase


def base_to_plain(base: DeltaBase) -> list[object]:
    """A worker's DeltaBase as a list that crosses collective_rpc (msgpack, or a server's JSON)."""
    return [base.digest, base.host_bytes, base.patch_seconds]


def base_from_plain(per_worker: Sequence[Sequence[object]]) -> DeltaBase:
    """The engine's DeltaBase from every worker's, as `base_to_plain` lists (see `combine`)."""
    return combine([DeltaBase(None if d is None else str(d), int(b), float(s)) for d, b, s in per_worker])  # type: ignore[call-overload,arg-type]


def combine(bases: Sequence[DeltaBase]) -> DeltaBase:
    """The engine's DeltaBase from every worker's: their digest when all agree (else None), their
    bytes summed, the slowest worker's seconds."""
    digests = {b.digest for b in bases}
    digest = digests.pop() if len(digests) == 1 else None
    return DeltaBase(digest, sum(b.host_bytes for b in bases), max((b.patch_seconds for b in bases), default=0.0))
