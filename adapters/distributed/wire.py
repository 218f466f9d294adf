"""The torch.distributed transport's wire format: frame headers, bucket metadata, lead records,
stream layouts and rank-status records.

A source sends each bucket as two messages: a fixed-size control message (the header's int64
words, then the bucket's tensor metadata as UTF-8 JSON; metadata too long for it follows in a
message of its own) and the flat buffer. The stream ends with an END header, or with an ABORT
header followed by the source's error text. Once both ends know a stream's layout, a bucket
travels as one message with a lead record in front. At each agreement point every rank
contributes one fixed-size status record, so all ranks learn who failed, where, and why, from one
all-gather. All of it is pure encoding: the collectives that move these bytes are in transport
and collectives.
"""

from __future__ import annotations

import enum
import functools
import json
import zlib
from collections.abc import Sequence

import attrs
import torch

from domain.errors import WireProtocolError
from domain.refit.buckets import TensorMeta
from domain.refit.status import EngineState, RankStatus

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

    def to_tensor(self, device: torch.device | None = None) -> torch.Tensor:
        """int64 [HEADER_WORDS], on `device` (the host when None)."""
        words = [MAGIC, int(self.kind), self.refit_id, self.index, int(self.is_last), self.nbytes, self.meta_len,
                 self.layout]
        return torch.tensor(words, dtype=torch.int64, device=device)

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
# Over gloo a receiver posts every receive this much larger than announced (TorchDistTransport's
# receivers): a source that sends more than it announced is then reported, not fatal. A receive
# buffer handed to the transport (`allocate`) with this much room after it is received in place.
RECEIVE_SLACK = 64 << 10
_INLINE = CONTROL_BYTES - HEADER_WORDS * 8


def encode_control(header: Header, body: torch.Tensor,
                   device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A header and its metadata (or error text) as one fixed-size control message.

    Args:
        header: the frame header (its meta_len must be body's length).
        body: uint8 metadata or error text.
        device: where the message is made (the transport's device: NCCL sends only GPU tensors);
            the host when None.

    Returns:
        (control message uint8 [CONTROL_BYTES], the rest of the body that did not fit, or None),
        both on `device`. One small message per bucket instead of two: per-message latency
        dominates small ones.
    """
    out = torch.zeros(CONTROL_BYTES, dtype=torch.uint8, device=device)
    out[: HEADER_WORDS * 8] = header.to_tensor(device).view(torch.uint8)
    n = min(body.numel(), _INLINE)
    out[HEADER_WORDS * 8 : HEADER_WORDS * 8 + n] = body[:n]
    rest = body[n:].to(out.device) if body.numel() > n else None
    return out, rest


def decode_control(control: torch.Tensor, refit_id: int, source: int) -> tuple[Header, torch.Tensor, int]:
    """Inverse of `encode_control`.

    Returns:
        (the checked header, the inline part of its body, bytes of body still to receive).
        Raises WireProtocolError for a negative body length.
    """
    header = Header.from_tensor(control[: HEADER_WORDS * 8].view(torch.int64), refit_id, source)
    if header.meta_len < 0:
        raise WireProtocolError(f"rank {source} (refit {refit_id}) announced a negative metadata size "
                                f"({header.meta_len})")
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
        if not isinstance(rows, list):
            raise TypeError(f"expected a list of tensors, got {type(rows).__name__}")
        metas = []
        for n, s, d, o, b in rows:
            dtype = getattr(torch, d) if isinstance(d, str) else None
            if not isinstance(n, str) or not isinstance(dtype, torch.dtype) or not all(isinstance(x, int) for x in (*s, o, b)):
                raise TypeError(f"malformed entry {[n, s, d, o, b]!r}"[:200])
            metas.append(TensorMeta(n, tuple(s), dtype, o, b))
        return tuple(metas)
    except (ValueError, TypeError, AttributeError, RecursionError) as err:
        raise WireProtocolError(f"corrupt bucket metadata: {err}") from None


@attrs.frozen
class StreamLimits:
    """What a receiver accepts from its source, checked before it allocates or receives anything.

    Both ends of a stream use the same bucket size (the refit's begin agreement checks it), so a
    bucket above it can only be a lone tensor, and the metadata of a bucket is small.

    Attributes:
        bucket_bytes: the agreed bucket capacity.
        max_tensor_bytes: the largest lone tensor (a bucket above bucket_bytes) accepted.
    """

    bucket_bytes: int
    max_tensor_bytes: int = 64 << 30

    @property
    def max_meta_bytes(self) -> int:
        """Metadata of one bucket: a few dozen bytes per tensor, far below this."""
        return max(CONTROL_BYTES, self.bucket_bytes // 4)

    def check_header(self, h: Header, source: int, expected: int | None, after_last: bool) -> None:
        """A BUCKET header against the limits and the order of the stream.

        Args:
            h: the decoded header.
            source: the sender, for errors.
            expected: the index this bucket must have (None: the stream's first bucket).
            after_last: a bucket marked last was already received.

        Returns:
            None. Raises WireProtocolError naming what is wrong.
        """
        who = f"rank {source} (refit {h.refit_id})"
        if after_last:
            raise WireProtocolError(f"{who} sent bucket {h.index} after the bucket it marked last")
        if h.index < 0 or (expected is not None and h.index != expected):
            due = f"bucket {expected} was due" if expected is not None else "indices start at 0 or above"
            raise WireProtocolError(f"{who} sent bucket {h.index} out of order ({due})")
        if h.nbytes < 0 or h.meta_len < 0:
            raise WireProtocolError(f"{who} announced a negative size for bucket {h.index} "
                                    f"({h.nbytes} data bytes, {h.meta_len} metadata bytes)")
        if h.nbytes > max(self.bucket_bytes, self.max_tensor_bytes):
            raise WireProtocolError(f"{who} announced {h.nbytes} bytes for bucket {h.index}, above the "
                                    f"{max(self.bucket_bytes, self.max_tensor_bytes)}-byte limit of one tensor")
        if h.meta_len > self.max_meta_bytes:
            raise WireProtocolError(f"{who} announced {h.meta_len} bytes of metadata for bucket {h.index}, above "
                                    f"the {self.max_meta_bytes}-byte limit")

    def check_metas(self, h: Header, metas: Sequence[TensorMeta], source: int) -> None:
        """A bucket's tensors against its header: they fill exactly its bytes, each name once, and
        only a bucket of one tensor exceeds the bucket size."""
        who = f"rank {source} (refit {h.refit_id})"
        end = metas[-1].end if metas else 0
        if end != h.nbytes:
            raise WireProtocolError(f"{who} announced {h.nbytes} bytes for bucket {h.index} but its tensors "
                                    f"occupy {end}")
        if h.nbytes > self.bucket_bytes and len(metas) != 1:
            raise WireProtocolError(f"{who} sent a {h.nbytes}-byte bucket {h.index} of {len(metas)} tensors; only "
                                    f"a lone tensor may exceed the {self.bucket_bytes}-byte bucket size")
        names = [m.name for m in metas]
        if len(set(names)) != len(names):
            raise WireProtocolError(f"{who} sent bucket {h.index} with a tensor named twice")

    @staticmethod
    def check_end(h: Header, source: int, count: int) -> None:
        """END closes a stream of `count` buckets and says so."""
        if h.index != count:
            raise WireProtocolError(f"rank {source} (refit {h.refit_id}) ended its stream after {h.index} buckets, "
                                    f"but {count} arrived")

    def check_abort(self, h: Header, source: int) -> None:
        if not 0 <= h.meta_len <= self.max_meta_bytes:
            raise WireProtocolError(f"rank {source} (refit {h.refit_id}) announced {h.meta_len} bytes of abort text")


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


def encode_lead(header: Header, text: str = "", device: torch.device | None = None) -> torch.Tensor:
    """A lead record on `device` (the host when None): the header words, then (ABORT) as much of
    the error text as fits."""
    body = text.encode()[:_LEAD_TEXT]
    header = attrs.evolve(header, meta_len=len(body))
    out = torch.zeros(LEAD_BYTES, dtype=torch.uint8, device=device)
    out[: HEADER_WORDS * 8] = header.to_tensor(device).view(torch.uint8)
    if body:
        out[HEADER_WORDS * 8 : HEADER_WORDS * 8 + len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    return out


def decode_lead(lead: torch.Tensor, refit_id: int, source: int) -> tuple[Header, str]:
    """Inverse of `encode_lead` (checks magic and refit id like `Header.from_tensor`)."""
    header = Header.from_tensor(lead[: HEADER_WORDS * 8].clone().view(torch.int64), refit_id, source)
    text = decode_text(lead[HEADER_WORDS * 8 : HEADER_WORDS * 8 + max(0, min(header.meta_len, _LEAD_TEXT))])
    return header, text


def encode_text(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else torch.empty(0, dtype=torch.uint8)


def decode_text(data: torch.Tensor) -> str:
    return bytes(data.tolist()).decode(errors="replace")


def encode_status(status: RankStatus) -> torch.Tensor:
    """One rank's status as a fixed-size record, uint8 [STATUS_BYTES] (long errors are cut)."""
    fields = [status.rank, status.role, status.ok, status.step, status.error, status.engine.value,
              status.fingerprint[:64]]
    body = json.dumps(fields).encode()
    if len(body) > _STATUS_TEXT:
        cut = max(0, len(status.error.encode()) - (len(body) - _STATUS_TEXT) - 8)
        fields[3], fields[4] = status.step[:200], status.error.encode()[:cut].decode(errors="ignore") + "..."
        body = json.dumps(fields).encode()
    out = torch.zeros(STATUS_BYTES, dtype=torch.uint8)
    out[:8] = torch.frombuffer(bytearray(len(body).to_bytes(8, "little")), dtype=torch.uint8)
    out[8 : 8 + len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    return out


def decode_status(t: torch.Tensor) -> RankStatus:
    """Inverse of `encode_status`. Raises WireProtocolError on a record that does not decode."""
    raw = bytes(t.tolist())
    n = int.from_bytes(raw[:8], "little")
    try:
        rank, role, ok, step, error, engine, fingerprint = json.loads(raw[8 : 8 + n].decode())
        return RankStatus(rank, role, ok, step, error, EngineState(engine), fingerprint)
    except (ValueError, TypeError) as err:
        raise WireProtocolError(f"corrupt rank status record: {err}") from None
