"""The fault vocabulary of tests and demos: where a refit is made to fail, and on which rank.

Faults are spelled `[hang:]POINT[:K]`, e.g. `bucket:2`, `export:0`, `finalize`, `hang:verify`:

| point | where it fails | who it hits |
|---|---|---|
| `begin` | when the refit opens | any rank |
| `export:K` | reading the K-th unit this rank exports or helps export | trainer ranks |
| `bucket:K` | bucket K: sent by a source, loaded by an engine | sources, engines |
| `finalize` | inside the engine's finalize, before anything is verified or committed | engines (trainers: while engines finalize) |
| `verify` | the engine's verification of the staged weights, just before it commits | engines (trainers: while engines finalize) |
| `storage` | the storage check after the engine committed | engines |

`hang:` makes the step sleep first (a hung peer), then fail. A FaultScript is one engine's
scripted failure (single-process refits, `refit demo --inject-fault`); a RankFault is a failure on
one rank of a distributed refit. Nothing in the domain or the production services knows these:
the composition root wraps the ports of the rank a fault hits (adapters.memory.faulty).
"""

from __future__ import annotations

import enum

import attrs

_SPELLING = "[hang:]POINT with POINT one of begin, export:K, bucket:K, finalize, verify, storage"


class FaultPoint(enum.Enum):
    BEGIN = "begin"  # the refit opens
    EXPORT = "export"  # the K-th export unit of a trainer rank
    BUCKET = "bucket"  # bucket K is sent or loaded
    FINALIZE = "finalize"  # post-processing, before anything is verified or committed
    VERIFY = "verify"  # the staged weights are verified, just before they are committed
    STORAGE = "storage"  # the captured-storage check, after the engine committed

    @property
    def indexed(self) -> bool:
        """Takes an index K (`export:K`, `bucket:K`)."""
        return self in (FaultPoint.EXPORT, FaultPoint.BUCKET)


def parse_fault(text: str) -> tuple[FaultPoint, int | None, bool]:
    """Read `[hang:]POINT[:K]`.

    Args:
        text: the fault's spelling.

    Returns:
        (point, index or None, hang). Raises ValueError saying what is accepted.
    """
    parts = text.strip().lower().split(":")
    hang = parts[0] == "hang"
    parts = parts[1:] if hang else parts
    try:
        point = FaultPoint(parts[0])
        if len(parts) != (2 if point.indexed else 1):
            raise ValueError
        index = int(parts[1]) if point.indexed else None
        if index is not None and index < 0:
            raise ValueError
    except (ValueError, IndexError):
        raise ValueError(f"unknown fault {text!r}; use {_SPELLING} (K >= 0)") from None
    return point, index, hang


def spell_fault(point: FaultPoint, index: int | None, hang: bool) -> str:
    text = point.value if index is None else f"{point.value}:{index}"
    return f"hang:{text}" if hang else text


def _point(value: FaultPoint | str) -> FaultPoint:
    return value if isinstance(value, FaultPoint) else FaultPoint(value)


@attrs.frozen
class FaultScript:
    """Where one engine fails, and for how many refits.

    Attributes:
        point: the lifecycle step that fails (not `export`: engines export nothing).
        bucket_index: for BUCKET, the index of the bucket whose load fails.
        after: how many refits succeed before the first scripted failure.
        refits: how many refits fail (the next ones succeed).
        hang: sleep before failing (a hung engine).
    """

    point: FaultPoint = attrs.field(converter=_point)
    bucket_index: int | None = None
    after: int = 0
    refits: int = 1
    hang: bool = False

    def __attrs_post_init__(self) -> None:
        if self.point is FaultPoint.EXPORT:
            raise ValueError("an engine exports nothing: export faults hit trainer ranks")
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
        """Read `[hang:]bucket:K`, `begin`, `finalize`, `verify` or `storage`.

        Args:
            text: the fault's spelling, as `refit demo --inject-fault` takes it.

        Returns:
            The FaultScript. Raises ValueError saying what is accepted.
        """
        point, index, hang = parse_fault(text)
        if point is FaultPoint.EXPORT:
            raise ValueError(f"unknown fault {text!r}: export:K needs trainer ranks (refit demo procs)")
        return cls(point, index, hang=hang)

    def __str__(self) -> str:
        return spell_fault(self.point, self.bucket_index, self.hang)


@attrs.frozen
class RankFault:
    """A failure (or a hang) injected on one rank at one step of one refit.

    Attributes:
        rank: the rank it hits.
        point: the step (see the module's table).
        index: for `export` and `bucket`.
        hang: sleep instead of failing at once (a hung peer), then fail.
        refit: the refit it hits, counted from 0 on this rank.
    """

    rank: int
    point: FaultPoint = attrs.field(converter=_point)
    index: int | None = None
    hang: bool = False
    refit: int = 0

    def __attrs_post_init__(self) -> None:
        if self.point.indexed != (self.index is not None):
            raise ValueError(f"fault {self.point.value!r}: export and bucket take an index (export:K, bucket:K), others none")
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
        point, index, hang = parse_fault(text)
        return cls(rank, point, index, hang, refit)

    def hits(self, rank: int, refit: int, point: FaultPoint | str, index: int | None = None) -> bool:
        """Whether this fault fires on `rank`, in refit number `refit`, at `point` (and `index`)."""
        return rank == self.rank and refit == self.refit and _point(point) is self.point and index == self.index

    def engine_script(self) -> FaultScript:
        """The same fault as an engine's script (engine ranks carry it out inside their engine)."""
        return FaultScript(self.point, self.index, after=self.refit, hang=self.hang)

    def __str__(self) -> str:
        return spell_fault(self.point, self.index, self.hang)
