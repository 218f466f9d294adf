"""Delta refits: both ends keep the last committed checkpoint-format tensors and send what changed.

The trainer's `DeltaSender` keeps, on the host, every checkpoint-format tensor of the last refit
that went live (codes and scales as sent). Before a refit it compares its copy's digest with the
engine's (`DeltaBase`) and decides: a full refit (every tensor whole) or a delta refit (each tensor
as a delta record or whole, whichever is smaller). The engine's `DeltaReceiver` keeps the copy it
last loaded, patches it with each record and hands whole tensors to the engine's normal load path,
so the engine computes with exactly what a full refit would have given it.

Both copies are updated in place while a refit streams (no second copy of the model): a refit that
goes live leaves them equal to what the engine loaded; a failure anywhere drops them, and the next
refit is full. Tensors past `max_host_bytes` (in stream order) are sent whole and kept by neither
side (they travel under UNKEPT_SUFFIX).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType

import attrs
import torch

from domain.errors import ConfigError, DeltaBaseMismatch
from domain.keys import key
from domain.refit.delta import (
    DELTA_SUFFIX,
    UNKEPT_SUFFIX,
    DeltaRecord,
    diff,
    nbytes,
    patch_,
    state_digest,
    tensor_digest,
)
from domain.refit.report import DeltaReport

Named = tuple[str, torch.Tensor]


@attrs.frozen
class DeltaBase:
    """What an engine's receiver holds, as the trainer asks before a refit.

    Attributes:
        digest: digest of its whole copy (`state_digest`); None when it holds none (a new or
            restarted engine, or one whose last refit failed).
        host_bytes: bytes of its copy.
        patch_seconds: seconds its last refit spent receiving (patching, hashing, keeping).
    """

    digest: str | None = None
    host_bytes: int = 0
    patch_seconds: float = 0.0


def _positive(_inst: object, attr: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ConfigError(key("checkpoint_engine", "delta", attr.name), f"must be >= 1, got {value}")


def _cap(_inst: object, attr: attrs.Attribute, value: int | None) -> None:
    if value is not None and value < 0:
        raise ConfigError(key("checkpoint_engine", "delta", attr.name), f"must be >= 0 or null (unlimited), got {value}")


def _keep(copy: dict[str, torch.Tensor], name: str, t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes into the copy under `name`: in place when the shapes agree, else a new host tensor."""
    old = copy.get(name)
    if old is not None and old.shape == t.shape and old.dtype == t.dtype:
        old.copy_(t)
        return old
    copy[name] = kept = t.detach().to("cpu", copy=True).contiguous()
    return kept


@attrs.define
class DeltaSender:
    """The trainer's end: decides full or delta, and turns the checkpoint stream into what is sent.

    Attributes:
        full_every: a full refit at least every this many refits (1: every refit is full).
        max_host_bytes: cap on the copy's bytes; tensors past it go whole and are not kept
            (None: unlimited).
    """

    full_every: int = attrs.field(default=10, validator=_positive)
    max_host_bytes: int | None = attrs.field(default=None, validator=_cap)
    _copy: dict[str, torch.Tensor] = attrs.field(init=False, factory=dict)
    _digests: dict[str, bytes] = attrs.field(init=False, factory=dict)
    _since_full: int = attrs.field(init=False, default=0)
    _lost: str | None = attrs.field(init=False, default="first refit: the trainer holds no copy")
    _full: bool = attrs.field(init=False, default=True)
    _why: str | None = attrs.field(init=False, default=None)
    _seen: set[str] = attrs.field(init=False, factory=set)
    _stats: dict[str, float] = attrs.field(init=False, factory=dict)

    @property
    def host_bytes(self) -> int:
        return sum(nbytes(t) for t in self._copy.values())

    def digest(self) -> str | None:
        """The digest of the trainer's copy (what the engine's must equal for a delta refit)."""
        return state_digest(self._digests)

    def begin(self, engine: DeltaBase) -> str | None:
        """Decide this refit's mode from the engine's base; returns why it is full (None: delta).

        A full refit drops the trainer's copy first (it is rebuilt as the refit streams).
        """
        mine = self.digest()
        if self._lost is not None:
            why: str | None = self._lost
        elif engine.digest is None:
            why = "the engine holds no base copy (a new or restarted engine, or its last refit failed)"
        elif engine.digest != mine:
            why = f"the engine's base copy ({engine.digest}) differs from the trainer's ({mine})"
        elif self._since_full + 1 >= self.full_every:
            why = f"full_every={self.full_every} reached"
        else:
            why = None
        self._full, self._why, self._seen = why is not None, why, set()
        self._stats = dict.fromkeys(("wire", "full", "delta", "whole", "seconds"), 0.0)
        if self._full:
            self._copy.clear()
            self._digests.clear()
        return why

    def stage(self, stream: Iterable[Named]) -> Iterator[Named]:
        """The stream as sent: each tensor whole, whole and unkept, or as a delta record."""
        kept_bytes = 0
        for name, t in stream:
            t0 = time.perf_counter()
            size = nbytes(t)
            self._stats["full"] += size
            self._seen.add(name)
            if self.max_host_bytes is not None and kept_bytes + size > self.max_host_bytes:
                self._copy.pop(name, None)
                self._digests.pop(name, None)
                out: Named = (name + UNKEPT_SUFFIX, t)
            else:
                kept_bytes += size
                out = self._kept(name, t)
            self._stats["delta" if out[0].endswith(DELTA_SUFFIX) else "whole"] += 1
            self._stats["wire"] += nbytes(out[1])
            self._stats["seconds"] += time.perf_counter() - t0
            yield out

    def _kept(self, name: str, t: torch.Tensor) -> Named:
        base = None if self._full else self._copy.get(name)
        host = t.detach().to("cpu").contiguous()
        new_digest = tensor_digest(host)
        record = None
        if base is not None and base.shape == host.shape and base.dtype == host.dtype:
            record = diff(base, host, base_digest=self._digests[name], new_digest=new_digest)
        _keep(self._copy, name, host)
        self._digests[name] = new_digest
        return (name + DELTA_SUFFIX, record.to_tensor()) if record is not None else (name, t)

    def commit(self) -> None:
        """The refit went live: the copy is what the engine loaded (tensors no longer sent dropped)."""
        for name in set(self._copy) - self._seen:
            del self._copy[name]
            self._digests.pop(name, None)
        self._since_full = 0 if self._full else self._since_full + 1
        self._lost = None

    @property
    def sending_deltas(self) -> bool:
        """Whether the refit begun last sends deltas (False: every tensor whole)."""
        return not self._full

    def discard(self, reason: str, *, why_full: str | None = None) -> None:
        """The refit failed: drop the copy; the next refit is full, saying `why_full` (default:
        that the previous refit failed, for `reason`)."""
        self._copy.clear()
        self._digests.clear()
        self._lost = why_full if why_full is not None else f"the previous refit failed ({reason})"

    def report(self, engine: DeltaBase | None = None) -> DeltaReport:
        """This refit's delta figures (the engine's from its base after the refit, when known)."""
        s = self._stats
        return DeltaReport(
            mode="full" if self._full else "delta", why_full=self._why, wire_bytes=int(s.get("wire", 0)),
            full_bytes=int(s.get("full", 0)), tensors_delta=int(s.get("delta", 0)),
            tensors_whole=int(s.get("whole", 0)), trainer_host_bytes=self.host_bytes,
            engine_host_bytes=engine.host_bytes if engine is not None else 0, diff_seconds=s.get("seconds", 0.0),
            patch_seconds=engine.patch_seconds if engine is not None else 0.0,
        )


@attrs.define
class DeltaReceiver:
    """The engine's end: patches its copy with each record and hands whole tensors on.

    Call `begin` when a refit opens, `receive` on each bucket's tensors (before the engine's own
    checks and load), `commit` once the engine committed, `discard` on any failure.
    """

    _copy: dict[str, torch.Tensor] = attrs.field(init=False, factory=dict)
    _digests: dict[str, bytes] = attrs.field(init=False, factory=dict)
    _seen: set[str] = attrs.field(init=False, factory=set)
    _seconds: float = attrs.field(init=False, default=0.0)

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """The copy by checkpoint name (read-only use: tests, checks)."""
        return MappingProxyType(self._copy)

    def base(self) -> DeltaBase:
        """The digest and bytes of the copy, and the last refit's receiving time."""
        return DeltaBase(state_digest(self._digests), sum(nbytes(t) for t in self._copy.values()), self._seconds)

    def begin(self) -> None:
        self._seen, self._seconds = set(), 0.0

    def receive(self, named: Iterable[Named]) -> list[Named]:
        """One bucket's tensors as the engine loads them: records patched into whole tensors,
        suffixes removed, kept tensors copied.

        Raises:
            DeltaBaseMismatch: a record for a tensor the receiver does not hold, made against
                another base, or patching into other bytes than the sender's (the caller fails the
                refit; `discard` then drops the copy).
        """
        t0 = time.perf_counter()
        out = [self._one(name, t) for name, t in named]
        self._seconds += time.perf_counter() - t0
        return out

    def _one(self, name: str, t: torch.Tensor) -> Named:
        if name.endswith(DELTA_SUFFIX):
            name = name.removesuffix(DELTA_SUFFIX)
            base = self._copy.get(name)
            if base is None:
                raise DeltaBaseMismatch(f"tensor {name!r}: a delta arrived but the receiver holds no copy of it; "
                                        "the delta is refused and the refit is sent whole")
            self._digests[name] = patch_(name, base, DeltaRecord.from_tensor(name, t), self._digests[name])
            self._seen.add(name)
            return name, base
        if name.endswith(UNKEPT_SUFFIX):
            name = name.removesuffix(UNKEPT_SUFFIX)
            self._copy.pop(name, None)
            self._digests.pop(name, None)
            self._seen.add(name)
            return name, t
        kept = _keep(self._copy, name, t)
        self._digests[name] = tensor_digest(kept)
        self._seen.add(name)
        return name, t

    def commit(self) -> None:
        """The engine committed: tensors this refit did not send are dropped from the copy."""
        for name in set(self._copy) - self._seen:
            del self._copy[name]
            self._digests.pop(name, None)

    def discard(self) -> None:
        """The refit failed (or the engine's weights are not the copy's): drop the copy."""
        self._copy.clear()
        self._digests.clear()
