"""One vLLM worker's refit session: the receiving end of rl-refit's weight-transfer backend.

A `WorkerSession` lives in each worker of a server started with
`--weight-transfer-config '{"backend": "rl_refit"}'` (adapters.vllm.transfer_backend builds it)
and is what vLLM's weight-transfer calls and rl-refit's worker extension calls reach:

| call | what the session does |
|---|---|
| init (`/init_weight_transfer_engine`) | checks the trainer's rl-refit version, takes the trainer's session token, joins its bucket transport (the shared-memory ring on one host, or a side group) |
| start (`/start_weight_update`) | begins vLLM's layerwise reload |
| update (`/update_weights`, the token in its update info) | receives one refit's bucket stream and loads every bucket; each bucket stays in a buffer of its own |
| finish (`/finish_weight_update`) | finalizes the reload, resets uncalibrated KV-cache scales, records the report |
| restore (`rl_refit_restore`) | puts the previous weights back (below) |

**The backup.** vLLM's layerwise reload writes each layer as soon as it is whole and keeps no
copy of the old weights. The session keeps the buckets of the last refit that went live (the
buffers they were received into: no extra copy is made, they are simply not dropped) and, before
any refit went live, the server's own checkpoint on disk. A failure anywhere (the stream, a
load, finalize, or the trainer refusing the refit after finalize) puts the previous weights back
by reloading those buckets through the same layerwise reload, so the engine serves exactly what
it served before. The cost: one more copy of the quantized checkpoint in the worker's memory
(docs/engines.md). Only a server started with dummy weights and not yet refitted has nothing to
restore from: it stays stale and says so.

**The token.** Dev mode exposes the server's control routes to anyone who reaches its port. The
session takes the token of the trainer that initialized it; every update, restore and commit must
carry it, and a different one is refused (SessionRefused) while a refit is in progress. An idle
session may be taken over by a new trainer (the previous one is gone, or restarted).
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import attrs
import structlog
import torch

from adapters.vllm.errors import SessionRefused
from adapters.vllm.worker import FinalizeStats, WorkerRefit
from domain.errors import EngineStale, RefitLifecycleError, WireProtocolError
from domain.refit.buckets import Bucket, unpack_bucket
from domain.refit.transport_choice import TRANSPORTS

log = structlog.get_logger()

BACKEND = "rl_refit"  # the name the backend is registered under in vLLM's weight-transfer factories


def rl_refit_version() -> str:
    """This installation's rl-refit version (the distribution's metadata; "unknown" without it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rl-refit")
    except PackageNotFoundError:
        return "unknown"


class Phase(enum.Enum):
    IDLE = "idle"  # serving; nothing in progress
    LOADING = "loading"  # between start and finish
    FINALIZED = "finalized"  # finish succeeded; the trainer may still refuse the refit (restore)


class RefitSteps(Protocol):
    """The steps of one refit on the worker's model (WorkerRefit's; rl-refit's worker extension
    routes them through its overridable hooks, so a subclass sees every load whichever way the
    refit came: adapters.vllm.extension)."""

    def begin(self) -> None: ...

    def load(self, named_tensors: list[tuple[str, torch.Tensor]], retained: bool = False) -> int: ...

    def finalize(self) -> FinalizeStats: ...

    def abort(self) -> None: ...


class Receiver(Protocol):
    """A bucket transport's receiving end (adapters.distributed: the ring's or the side group's)."""

    refit_id: int

    @property
    def device(self) -> torch.device: ...

    def receive(self, consume: Callable[[Bucket], None], allocate: Callable[[int], torch.Tensor] | None = None) -> Any: ...

    def forget_layout(self) -> None: ...

    def close(self) -> None: ...


@attrs.frozen
class InitInfo:
    """What a trainer sends once (`/init_weight_transfer_engine`'s init_info): plain values.

    Attributes:
        token: the trainer's session token (hex).
        version: the trainer's rl-refit version; the worker refuses another.
        transport: shm (the ring on this host), cuda_ipc (the trainer's GPU buffers on this host),
            gloo or nccl (a side group); adapters.distributed.transports builds each.
        rendezvous: where the transport is found (ShmRendezvous or side_group.Rendezvous, as dict).
        bucket_bytes: the bucket capacity.
        timeout_s: bound on joining and on every wait of a stream.
        backup: keep the last live refit's buckets to restore from (default true).
    """

    token: str = attrs.field(converter=str)
    version: str = attrs.field(converter=str)
    transport: str = attrs.field(converter=str, validator=attrs.validators.in_(TRANSPORTS))
    rendezvous: dict[str, Any] = attrs.field(converter=dict)
    bucket_bytes: int = attrs.field(converter=int)
    timeout_s: float = attrs.field(converter=float, default=120.0)
    backup: bool = attrs.field(converter=bool, default=True)

    @classmethod
    def of(cls, value: Mapping[str, Any]) -> InitInfo:
        try:
            return cls(**dict(value))
        except (TypeError, ValueError) as err:
            raise WireProtocolError(f"a malformed rl_refit init_info ({err}): the trainer and the server run "
                                    "different rl-refit versions (install the same one on both sides)") from err


@attrs.frozen
class UpdateInfo:
    """One refit's stream (`/update_weights`' update_info): the token, the refit's id, and whether
    the stream carries its metadata again (its layout may differ from the last: delta refits)."""

    token: str = attrs.field(converter=str)
    refit_id: int = attrs.field(converter=int)
    relearn: bool = attrs.field(converter=bool, default=False)

    @classmethod
    def of(cls, value: Mapping[str, Any]) -> UpdateInfo:
        try:
            return cls(**dict(value))
        except (TypeError, ValueError) as err:
            raise WireProtocolError(f"a malformed rl_refit update_info ({err})") from err


def join(info: InitInfo, rank: int) -> Receiver:
    """The receiving end of the trainer's transport, as worker `rank` (1 and up)."""
    from adapters.distributed.transports import join_transport

    return _Linked(join_transport(info.transport, info.rendezvous, rank, info.bucket_bytes))


@attrs.define
class _Linked:
    """A transport's receiving end and what closes it (adapters.distributed.transports.TransportLink)."""

    link: Any

    @property
    def refit_id(self) -> int:
        return int(self.link.transport.refit_id)

    @refit_id.setter
    def refit_id(self, value: int) -> None:
        self.link.transport.refit_id = value

    @property
    def device(self) -> torch.device:
        return torch.device(self.link.transport.device)

    def receive(self, consume: Callable[[Bucket], None], allocate: Callable[[int], torch.Tensor] | None = None) -> Any:
        return self.link.transport.receive(consume, allocate=allocate)

    def forget_layout(self) -> None:
        self.link.transport.forget_layout()

    def close(self) -> None:
        self.link.close()


@attrs.define
class WorkerSession:
    """One worker's refit session (see the module's docstring).

    Attributes:
        refit: the worker's WorkerRefit (vLLM's layerwise reload on its model).
        rank: the worker's rank in the transport (1 + vLLM's worker rank).
        reload_from_disk: puts the server's own checkpoint back (vLLM's `reload_weights` from the
            model path it started with); None when it started with dummy weights.
        joiner: joins a transport (tests replace it).
        allocate: a receive buffer of n bytes of its own (huge pages on CPU); None: a plain tensor
            on the transport's device.
    """

    refit: WorkerRefit
    rank: int = 1
    reload_from_disk: Callable[[], None] | None = None
    joiner: Callable[[InitInfo, int], Receiver] = join
    allocate: Callable[[int], torch.Tensor] | None = None
    steps: RefitSteps | None = attrs.field(init=False, default=None)  # None: the WorkerRefit's own
    token: str | None = attrs.field(init=False, default=None)
    info: InitInfo | None = attrs.field(init=False, default=None)
    phase: Phase = attrs.field(init=False, default=Phase.IDLE)
    receiver: Receiver | None = attrs.field(init=False, default=None)
    refit_id: int = attrs.field(init=False, default=0)
    received: list[Bucket] = attrs.field(init=False, factory=list)
    backup: list[Bucket] | None = attrs.field(init=False, default=None)
    report: FinalizeStats | None = attrs.field(init=False, default=None)
    error: BaseException | None = attrs.field(init=False, default=None)
    stale_reason: str | None = attrs.field(init=False, default=None)
    restores: int = attrs.field(init=False, default=0)
    restored_since_start: bool = attrs.field(init=False, default=False)
    went_live: bool = attrs.field(init=False, default=False)  # a refit went live: the checkpoint on disk is old

    @property
    def _steps(self) -> RefitSteps:
        return self.steps if self.steps is not None else self.refit

    # --- the session ------------------------------------------------------------------------

    def init(self, info: InitInfo) -> None:
        """Take the trainer's session: check its version, keep its token, join its transport.

        Refused (SessionRefused) while another trainer's refit is loading; a session between
        refits is taken over (its transport is left first)."""
        mine = rl_refit_version()
        if info.version != mine:
            raise WireProtocolError(f"the trainer runs rl-refit {info.version}, this server's workers {mine}: "
                                    "install the same rl-refit version on both sides")
        if self.token is not None and self.phase is Phase.LOADING and not _same(self.token, info.token):
            raise SessionRefused(f"worker {self.rank}: another trainer's refit {self.refit_id} is in progress; "
                                 "wait for it to end, or restart the server")
        if self.phase is Phase.FINALIZED:
            self._keep_as_backup()
        self.leave()
        self.receiver = self.joiner(info, self.rank)
        self.token, self.info = info.token, info
        log.info("rl-refit session joined", rank=self.rank, transport=info.transport, version=info.version)

    def check(self, token: str | None) -> None:
        """SessionRefused unless `token` is the session's."""
        if self.token is None:
            raise SessionRefused(f"worker {self.rank} has no rl-refit session: initialize the weight transfer "
                                 "first (/init_weight_transfer_engine with rl-refit's init_info)")
        if token is None or not _same(self.token, token):
            raise SessionRefused(f"worker {self.rank}: this call does not carry the session token of the trainer "
                                 "that holds the session; only that trainer can drive its refits")

    def leave(self) -> None:
        """Leave the transport (the session's backup is kept)."""
        receiver, self.receiver = self.receiver, None
        if receiver is not None:
            receiver.close()

    # --- one refit --------------------------------------------------------------------------

    def start(self) -> None:
        """Begin a refit: the previous one becomes the backup, vLLM's layerwise reload starts."""
        if self.phase is Phase.LOADING:
            raise RefitLifecycleError(f"worker {self.rank}: refit {self.refit_id} is still loading; "
                                      "finish or restore it first")
        if self.phase is Phase.FINALIZED:
            self._keep_as_backup()
        self.received = []
        self.error = None
        self.report = None
        self.restored_since_start = False
        self._steps.begin()
        self.phase = Phase.LOADING

    def update(self, info: UpdateInfo) -> int:
        """Receive refit `info.refit_id`'s stream and load every bucket; returns the tensors
        loaded. On any failure the previous weights are put back, then the error is raised."""
        self.check(info.token)
        if self.phase is not Phase.LOADING:
            raise RefitLifecycleError(f"worker {self.rank}: update before start: call start_weight_update first")
        if self.receiver is None:
            raise RefitLifecycleError(f"worker {self.rank}: no transport: initialize the weight transfer first")
        receiver = self.receiver
        self.refit_id = info.refit_id
        receiver.refit_id = info.refit_id
        if info.relearn:
            receiver.forget_layout()
        loaded = 0

        def consume(bucket: Bucket) -> None:
            nonlocal loaded
            self.received.append(bucket)  # its buffer is this worker's own: kept, and loaded without a copy
            loaded += self._steps.load(list(unpack_bucket(bucket)), True)

        # each bucket in a buffer of its own: kept as the backup, never overwritten by the next stream
        allocate = self.allocate or (lambda n: torch.empty(n, dtype=torch.uint8, device=receiver.device))
        try:
            receiver.receive(consume, allocate=allocate)
        except BaseException as err:
            self._failed(f"receiving refit {info.refit_id}", err)
            raise
        return loaded

    def load(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Load tensors given in this process (an in-process trainer); they are copied, so the
        backup holds its own bytes."""
        if self.phase is not Phase.LOADING:
            raise RefitLifecycleError(f"worker {self.rank}: load before start: call start_weight_update first")
        try:
            return self._steps.load(named, False)
        except BaseException as err:
            self._failed("loading", err)
            raise

    def finish(self) -> FinalizeStats:
        """Finalize the reload; on failure the previous weights are put back, then the error is
        raised. The report stays readable (`report`) until the next refit."""
        if self.phase is not Phase.LOADING:
            raise RefitLifecycleError(f"worker {self.rank}: finish without a loading refit: start one first")
        try:
            self.report = self._steps.finalize()
        except BaseException as err:
            self.phase = Phase.IDLE  # finalize ended the reload either way
            self._failed(f"finalizing refit {self.refit_id}", err, loading=False)
            raise
        self.phase = Phase.FINALIZED
        self.stale_reason = None
        return self.report

    def commit(self, token: str | None) -> None:
        """The trainer accepted the refit: it becomes the backup (also implied by the next start)."""
        self.check(token)
        if self.phase is Phase.FINALIZED:
            self._keep_as_backup()
            self.phase = Phase.IDLE

    def restore(self, token: str | None, reason: str) -> bool:
        """Put the previous weights back (the trainer refused the refit, or it failed); True when
        they are back, False when there was nothing to restore from (the engine is then stale).
        Idempotent: weights already restored since the last start are not reloaded."""
        self.check(token)
        if self.phase is Phase.IDLE and self.restored_since_start:
            return self.stale_reason is None
        return self._restore(reason)

    # --- internals ----------------------------------------------------------------------------

    def _keep_as_backup(self) -> None:
        # a delta refit's buckets patch the copy they were made against: they cannot be loaded again
        keep = (self.info is None or self.info.backup) and getattr(self.refit, "delta", None) is None
        self.backup = list(self.received) if keep else None
        self.went_live = True
        self.received = []
        self.phase = Phase.IDLE

    def _failed(self, step: str, err: BaseException, *, loading: bool = True) -> None:
        self.error = err
        log.warning("rl-refit refit failed on the worker; restoring the previous weights", rank=self.rank,
                    refit_id=self.refit_id, step=step, error=f"{type(err).__name__}: {err}")
        if loading:
            self._steps.abort()
            self.phase = Phase.IDLE
        self._restore(f"{step}: {type(err).__name__}: {err}")

    def _restore(self, reason: str) -> bool:
        if self.phase is Phase.LOADING:
            self.refit.abort()
        self.phase = Phase.IDLE
        self.received = []
        self.restored_since_start = True
        try:
            if self.backup is not None:
                self.refit.begin()
                try:
                    for bucket in self.backup:
                        self.refit.load(list(unpack_bucket(bucket)), True)
                except BaseException:
                    self.refit.abort()
                    raise
                self.refit.finalize()
            elif self.reload_from_disk is not None and not self.went_live:
                self.reload_from_disk()
            else:
                why = ("no backup of the last live refit is kept (delta refits, or init_info backup=false)"
                       if self.went_live else "no refit went live before and the server started without weights "
                       "to reload (load_format=dummy)")
                self.stale_reason = f"{reason}; {why}: a full refit must succeed"
                log.error("rl-refit cannot restore: the engine is stale", rank=self.rank, reason=self.stale_reason)
                return False
        except BaseException as err:
            self.stale_reason = f"{reason}; restoring the previous weights failed: {type(err).__name__}: {err}"
            log.error("rl-refit restore failed: the engine is stale", rank=self.rank, error=str(err))
            return False
        self.restores += 1
        self.stale_reason = None
        log.info("rl-refit restored the previous weights", rank=self.rank, refit_id=self.refit_id)
        return True

    def check_serving(self) -> None:
        """EngineStale when the worker's weights are incomplete (a failed refit it could not undo)."""
        if self.stale_reason is not None:
            raise EngineStale(self.stale_reason)


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())
