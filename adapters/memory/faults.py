"""The fault vocabulary of tests and demos: where a refit is made to fail, and on which rank.

- FaultScript: one engine's scripted failure (`bucket:K`, `finalize`, `verify`), for
  `refit demo --inject-fault` and the single-process tests (ScriptedFaultyEngine carries it out).
- RankFault: a failure or a hang on one rank of a distributed refit, at any step (`begin`,
  `export:K`, `bucket:K`, `finalize`, `verify`), carried out by the fault wrappers around that
  rank's ports (adapters.memory.faulty).

Nothing in the domain or the production services knows these; the composition root wraps the
ports of the rank a fault hits.
"""

from __future__ import annotations

import enum

import attrs


class FaultPoint(enum.Enum):
    BUCKET = "bucket"  # while loading bucket K
    FINALIZE = "finalize"  # while post-processing, before anything is verified or committed
    VERIFY = "verify"  # when the staged weights are verified, just before they are committed


@attrs.frozen
class FaultScript:
    """Where a scripted engine fails, and for how many refits.

    Attributes:
        point: the lifecycle step that fails.
        bucket_index: for BUCKET, the index of the bucket whose load fails.
        after: how many refits succeed before the first scripted failure.
        refits: how many refits fail (the next ones succeed).
    """

    point: FaultPoint
    bucket_index: int | None = None
    after: int = 0
    refits: int = 1

    def __attrs_post_init__(self) -> None:
        if (self.point is FaultPoint.BUCKET) != (self.bucket_index is not None):
            raise ValueError("a bucket fault needs bucket_index >= 0; other faults take none")
        if self.bucket_index is not None and self.bucket_index < 0:
            raise ValueError(f"bucket_index must be >= 0, got {self.bucket_index}")
        if self.after < 0 or self.refits < 0:
            raise ValueError("after and refits count refits: they must be >= 0")

    def fails(self, refit_number: int) -> bool:
        """Whether the refit_number-th refit (from 0) is one the script fails."""
        return self.after <= refit_number < self.after + self.refits

    @classmethod
    def parse(cls, text: str) -> FaultScript:
        """Read `bucket:K`, `finalize` or `verify`.

        Args:
            text: the fault's spelling, as `refit demo --inject-fault` takes it.

        Returns:
            The FaultScript. Raises ValueError saying what is accepted.
        """
        head, _, tail = text.strip().lower().partition(":")
        try:
            point = FaultPoint(head)
            index = int(tail) if point is FaultPoint.BUCKET else None
            if point is not FaultPoint.BUCKET and tail:
                raise ValueError
            return cls(point, index)
        except ValueError:
            raise ValueError(f"unknown fault {text!r}; use bucket:K (K >= 0), finalize or verify") from None

    def __str__(self) -> str:
        return f"bucket:{self.bucket_index}" if self.point is FaultPoint.BUCKET else self.point.value


# --- distributed refits ------------------------------------------------------------------------

FAULT_POINTS = ("begin", "export", "bucket", "finalize", "verify")


@attrs.frozen
class RankFault:
    """A failure (or a hang) injected on one rank at one step of one refit.

    Attributes:
        rank: the rank it hits.
        point: `begin`, `export` (the index-th unit this rank exports or helps export), `bucket`
            (the bucket with that index: sent by a source, loaded by an engine), `finalize` or
            `verify` (engines: inside finalize / the verification before commit; trainers: they
            report a failure while the engines finalize).
        index: for `export` and `bucket`.
        hang: sleep instead of failing at once (a hung peer), then fail.
        refit: the refit it hits, counted from 0 on this rank's service.
    """

    rank: int
    point: str = attrs.field(validator=attrs.validators.in_(FAULT_POINTS))
    index: int | None = None
    hang: bool = False
    refit: int = 0

    def __attrs_post_init__(self) -> None:
        if (self.point in ("export", "bucket")) != (self.index is not None):
            raise ValueError(f"fault {self.point!r}: export and bucket take an index (export:K, bucket:K), others none")
        if (self.index is not None and self.index < 0) or self.refit < 0 or self.rank < 0:
            raise ValueError("fault rank, index and refit must be >= 0")

    @classmethod
    def parse(cls, text: str, rank: int, refit: int = 0) -> RankFault:
        """Read `[hang:]POINT[:K]`, e.g. `bucket:2`, `export:0`, `finalize`, `hang:bucket:1`.

        Args:
            text: the fault's spelling.
            rank: the rank it hits.
            refit: the refit it hits (0 = the first).

        Returns:
            The RankFault. Raises ValueError saying what is accepted.
        """
        parts = text.strip().lower().split(":")
        hang = parts[0] == "hang"
        parts = parts[1:] if hang else parts
        try:
            index = int(parts[1]) if len(parts) == 2 else None
            if len(parts) not in (1, 2):
                raise ValueError
            return cls(rank, parts[0], index, hang, refit)
        except ValueError:
            raise ValueError(
                f"unknown fault {text!r}; use [hang:]POINT with POINT one of begin, export:K, bucket:K, "
                "finalize, verify"
            ) from None

    def hits(self, rank: int, refit: int, point: str, index: int | None = None) -> bool:
        """Whether this fault fires on `rank`, in refit number `refit`, at `point` (and `index`)."""
        return rank == self.rank and refit == self.refit and point == self.point and index == self.index

    def __str__(self) -> str:
        text = self.point if self.index is None else f"{self.point}:{self.index}"
        return f"hang:{text}" if self.hang else text
