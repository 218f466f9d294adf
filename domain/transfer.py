"""What travels between ranks besides bucket bytes: frame headers, bucket metadata, rank statuses.

A source sends each bucket as two messages: a fixed-size control message (the header's int64
words, then the bucket's tensor metadata as UTF-8 JSON; metadata too long for it follows in a
message of its own) and the flat buffer. The stream ends with an END header, or with an ABORT
header followed by the source's error text. At each agreement point every rank contributes one
fixed-size RankStatus record, so all ranks learn who failed, where, and why, from one all-gather.
All of it is pure encoding: the collectives that move these bytes live in the transport adapter.
"""

from __future__ import annotations

import enum
import functools
import json
import zlib
from collections.abc import Sequence

import attrs
import torch

from domain.buckets import TensorMeta
from domain.errors import WireProtocolError

MAGIC = 0x52_45_46_49_54  # "REFIT"
HEADER_WORDS = 8
STATUS_BYTES = 1024  # one rank's status record on the wire
_STATUS_TEXT = STATUS_BYTES - 16


class FrameKind(enum.IntEnum):
    BUCKET = 1  # metadata and a buffer follow
    END = 2  # the source has no more buckets for this refit
    ABORT = 3  # the source failed; its error text follows


@attrs.frozen
class Header:
    """One frame header.

    Attributes:
        kind: BUCKET, END or ABORT.
        refit_id: the refit it belongs to (a mismatch means ranks are out of step).
        index: the bucket's index in the refit (BUCKET).
        is_last: the bucket is the refit's last (BUCKET).
        nbytes: bytes of the buffer that follows (BUCKET).
        meta_len: bytes of the metadata (BUCKET) or error text (ABORT) that follow.
        layout: in a lead record, the digest of the stream layout the bucket follows (0 elsewhere).
    """

    kind: FrameKind
    refit_id: int
    index: int = 0
    is_last: bool = False
    nbytes: int = 0
    meta_len: int = 0
    layout: int = 0

    def to_tensor(self) -> torch.Tensor:
        """int64 [HEADER_WORDS]."""
        words = [MAGIC, int(self.kind), self.refit_id, self.index, int(self.is_last), self.nbytes, self.meta_len,
                 self.layout]
        return torch.tensor(words, dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, refit_id: int, source: int) -> Header:
        """Decode and check a header received from rank `source` during refit `refit_id`.

        Args:
            t: int64 [HEADER_WORDS].
            refit_id: the refit the receiver is in.
            source: the sender, for errors.

        Returns:
            The Header. Raises WireProtocolError when the magic, kind or refit id is wrong.
        """
        w = [int(x) for x in t.tolist()]
        if w[0] != MAGIC or w[1] not in FrameKind._value2member_map_:
            raise WireProtocolError(f"refit {refit_id}: corrupt frame header from rank {source}: {w}")
        if w[2] != refit_id:
            raise WireProtocolError(
                f"rank {source} sent a frame of refit {w[2]} while this rank is in refit {refit_id}; "
                "ranks are out of step: restart the refit world"
            )
        return cls(FrameKind(w[1]), w[2], w[3], bool(w[4]), w[5], w[6], w[7])


CONTROL_BYTES = 64 << 10  # one control message: the header words, then as much metadata as fits
_INLINE = CONTROL_BYTES - HEADER_WORDS * 8


def encode_control(header: Header, body: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A header and its metadata (or error text) as one fixed-size control message.

    Args:
        header: the frame header (its meta_len must be body's length).
        body: uint8 metadata or error text.

    Returns:
        (control message uint8 [CONTROL_BYTES], the rest of the body that did not fit, or None).
        One small message per bucket instead of two: per-message latency dominates small ones.
    """
    out = torch.zeros(CONTROL_BYTES, dtype=torch.uint8)
    out[: HEADER_WORDS * 8] = header.to_tensor().view(torch.uint8)
    n = min(body.numel(), _INLINE)
    out[HEADER_WORDS * 8 : HEADER_WORDS * 8 + n] = body[:n]
    return out, (body[n:] if body.numel() > n else None)


def decode_control(control: torch.Tensor, refit_id: int, source: int) -> tuple[Header, torch.Tensor, int]:
    """Inverse of `encode_control`.

    Returns:
        (the checked header, the inline part of its body, bytes of body still to receive).
    """
    header = Header.from_tensor(control[: HEADER_WORDS * 8].view(torch.int64), refit_id, source)
    n = min(header.meta_len, _INLINE)
    return header, control[HEADER_WORDS * 8 : HEADER_WORDS * 8 + n], header.meta_len - n


def encode_metas(metas: Sequence[TensorMeta]) -> torch.Tensor:
    """A bucket's tensor metadata as uint8 (UTF-8 JSON of name, shape, dtype, offset, nbytes)."""
    rows = [[m.name, list(m.shape), str(m.dtype).removeprefix("torch."), m.offset, m.nbytes] for m in metas]
    return encode_text(json.dumps(rows, separators=(",", ":")))


def decode_metas(data: torch.Tensor) -> tuple[TensorMeta, ...]:
    """Inverse of `encode_metas`. Raises WireProtocolError on bytes that do not decode."""
    try:
        rows = json.loads(decode_text(data))
        return tuple(TensorMeta(n, tuple(s), getattr(torch, d), o, b) for n, s, d, o, b in rows)
    except (ValueError, TypeError, AttributeError) as err:
        raise WireProtocolError(f"corrupt bucket metadata: {err}") from None


# The lead record: the first bytes of a bucket's first message once the stream layout is known.
# Planners of distributed streams leave this much room in front of each packed bucket's tensors,
# so the record rides in the same message as the data (one message per bucket, no control).
LEAD_BYTES = 256
_LEAD_TEXT = LEAD_BYTES - HEADER_WORDS * 8


@attrs.frozen(slots=False)  # slots=False: the digest is a cached_property
class StreamLayout:
    """The shape of one source's bucket stream: every bucket's wire size and tensors, in order.

    Both ends learn it from the first complete stream (control messages carry the metadata); it
    stays the same while the plan, the model, the bucket size and the alignment do (what the
    refit's begin agreement checks). Afterwards a bucket travels as its data alone, with a lead
    record in front, and the receiver posts each receive as soon as the previous bucket is in.

    Attributes:
        buckets: per bucket, (bytes on the wire, its tensors).
    """

    buckets: tuple[tuple[int, tuple[TensorMeta, ...]], ...]

    @functools.cached_property
    def digest(self) -> int:
        """A 31-bit checksum of the layout, carried by every lead record."""
        rows = [(n, [(m.name, m.shape, str(m.dtype), m.offset, m.nbytes) for m in metas]) for n, metas in self.buckets]
        return zlib.crc32(repr(rows).encode()) & 0x7FFF_FFFF

    def __len__(self) -> int:
        return len(self.buckets)

    @staticmethod
    def has_lead_room(metas: Sequence[TensorMeta]) -> bool:
        """The bucket's buffer has LEAD_BYTES free in front of its first tensor (packed buckets of
        a lead-reserving planner; not a lone large tensor, not an empty bucket)."""
        return bool(metas) and metas[0].offset >= LEAD_BYTES


def encode_lead(header: Header, text: str = "") -> torch.Tensor:
    """A lead record: the header words, then (ABORT) as much of the error text as fits."""
    body = text.encode()[:_LEAD_TEXT]
    header = attrs.evolve(header, meta_len=len(body))
    out = torch.zeros(LEAD_BYTES, dtype=torch.uint8)
    out[: HEADER_WORDS * 8] = header.to_tensor().view(torch.uint8)
    if body:
        out[HEADER_WORDS * 8 : HEADER_WORDS * 8 + len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    return out


def decode_lead(lead: torch.Tensor, refit_id: int, source: int) -> tuple[Header, str]:
    """Inverse of `encode_lead` (checks magic and refit id like `Header.from_tensor`)."""
    header = Header.from_tensor(lead[: HEADER_WORDS * 8].clone().view(torch.int64), refit_id, source)
    text = decode_text(lead[HEADER_WORDS * 8 : HEADER_WORDS * 8 + min(header.meta_len, _LEAD_TEXT)])
    return header, text


def encode_text(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else torch.empty(0, dtype=torch.uint8)


def decode_text(data: torch.Tensor) -> str:
    return bytes(data.tolist()).decode(errors="replace")


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
    role: str
    ok: bool = True
    step: str = ""
    error: str = ""
    engine: EngineState = EngineState.NONE
    fingerprint: str = ""

    def to_tensor(self) -> torch.Tensor:
        """uint8 [STATUS_BYTES]."""
        fields = [self.rank, self.role, self.ok, self.step, self.error, self.engine.value, self.fingerprint[:64]]
        body = json.dumps(fields).encode()
        if len(body) > _STATUS_TEXT:
            cut = max(0, len(self.error.encode()) - (len(body) - _STATUS_TEXT) - 8)
            fields[3], fields[4] = self.step[:200], self.error.encode()[:cut].decode(errors="ignore") + "..."
            body = json.dumps(fields).encode()
        out = torch.zeros(STATUS_BYTES, dtype=torch.uint8)
        out[:8] = torch.frombuffer(bytearray(len(body).to_bytes(8, "little")), dtype=torch.uint8)
        out[8 : 8 + len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
        return out

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> RankStatus:
        raw = bytes(t.tolist())
        n = int.from_bytes(raw[:8], "little")
        try:
            rank, role, ok, step, error, engine, fingerprint = json.loads(raw[8 : 8 + n].decode())
            return cls(rank, role, ok, step, error, EngineState(engine), fingerprint)
        except (ValueError, TypeError) as err:
            raise WireProtocolError(f"corrupt rank status record: {err}") from None

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


# --- fault scripts for distributed refits (tests and `refit demo --procs N --inject-fault`) --------

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
