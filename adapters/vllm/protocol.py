"""The worker protocol: one request and one reply record per `rl_refit_*` RPC, and the errors that
cross with them.

Every side speaks these records: the worker extension (adapters.vllm.extension, inside vLLM's
workers), the colocated client (adapters.vllm.client.ExtensionWorkers, `LLM.collective_rpc` in
this process) and the engine controls (adapters.vllm.controls: a server's HTTP `/collective_rpc`,
an AsyncLLM's, a Ray actor's). A request names its RPC (`METHOD`, vLLM's collective_rpc method
name) and its reply record (`REPLY`); `to_plain()` turns a record into a dict of plain values
(ints, floats, strings, bools, bytes, lists, dicts, tagged with the record's name) that crosses
vLLM's msgpack unchanged (and JSON with bytes base64-encoded: `json_safe`), and `from_plain()`
rebuilds it, refusing with WireProtocolError anything that is not that record.

A worker never lets an error escape an RPC (vLLM would turn it into text): it answers with an
`ErrorReply` (the error's type name, its message and its plain attributes), and the trainer
raises it again as the same class (`ErrorReply.rebuild`). The classes that may cross are listed
in ERRORS; any other type becomes a WorkerError naming it.

The colocated `Load` is the one record that is not plain: it carries a bucket's tensors by
reference, and only ever crosses within one process.
"""

from __future__ import annotations

import enum
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar, runtime_checkable

import attrs
import structlog
import torch

from adapters.vllm.errors import (
    EngineProcessError,
    EngineRefitUnsupported,
    SessionRefused,
    WorkerError,
)
from domain import errors
from domain.refit.delta_sync import DeltaBase
from domain.refit.storage import StorageFingerprint

log = structlog.get_logger()

# rl-refit's worker extension (`worker_extension_cls`): the class that answers every request below
# in each worker.
EXTENSION = "adapters.vllm.extension.RefitWorkerExtension"
TAG = "record"  # the key of a plain record that names its class
MAX_MESSAGE = 8000  # characters of an error message that cross


def plain(value: Any) -> Any:
    """`value` as msgpack and JSON carry it: tuples as lists, mappings as dicts with string keys."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


R = TypeVar("R", bound="Record")
Q = TypeVar("Q", bound="Request[Any]")


class Record:
    """A frozen attrs record that crosses process boundaries as a tagged dict of plain values."""

    def to_plain(self) -> dict[str, Any]:
        """The record as a dict of plain values, tagged with the record's name."""
        out: dict[str, Any] = {TAG: type(self).__name__}
        for field in attrs.fields(type(self)):  # type: ignore[arg-type]
            out[field.name] = plain(getattr(self, field.name))
        return out

    @classmethod
    def from_plain(cls: type[R], value: Any) -> R:
        """The record `to_plain` made; WireProtocolError for anything else (another record, a
        missing or extra field, a value of the wrong kind)."""
        if not isinstance(value, Mapping) or value.get(TAG) != cls.__name__:
            got = value.get(TAG) if isinstance(value, Mapping) else type(value).__name__
            raise errors.WireProtocolError(
                f"expected a {cls.__name__} record, got {got!r}: the trainer and the engine's workers run "
                "different rl-refit versions (install the same one on both sides)")
        names = {field.name for field in attrs.fields(cls)}  # type: ignore[arg-type]
        given = set(value) - {TAG}
        if given != names:
            raise errors.WireProtocolError(
                f"a {cls.__name__} record with fields {sorted(given)} instead of {sorted(names)}: the trainer and "
                "the engine's workers run different rl-refit versions (install the same one on both sides)")
        try:
            return cls(**{name: value[name] for name in names})
        except (TypeError, ValueError) as err:
            raise errors.WireProtocolError(f"a malformed {cls.__name__} record: {err}") from err


class Access(enum.Enum):
    """Who may send a request to a worker of a server (dev mode opens `/collective_rpc` to whoever
    reaches the port); in-process (colocated) there is no session and nothing to check."""

    READ = "read"  # it changes nothing: anyone may ask
    WRITE = "write"  # it changes the worker: on a server, only with the session's token
    SESSION = "session"  # a server's session step: only there (ServerMismatch elsewhere), with its token


class Request(Record, Generic[R]):
    """A request: the worker extension's method that answers it (`METHOD`), the record of its
    reply (`REPLY`) and who may send it (`ACCESS`). The extension's method is derived from the
    record (adapters.vllm.extension.serves): it checks the access, then answers with the handler
    `_rl_refit_on_<name>` (`handler()`), where METHOD is `rl_refit_<name>`."""

    METHOD: ClassVar[str]
    REPLY: ClassVar[type[Record]]
    ACCESS: ClassVar[Access] = Access.WRITE

    @classmethod
    def handler(cls) -> str:
        """The name of the extension's method that answers the request (`rl_refit_x` ->
        `_rl_refit_on_x`)."""
        return "_rl_refit_on_" + cls.METHOD.removeprefix("rl_refit_")


def tuple_of(value: Any) -> tuple[Any, ...]:
    return tuple(value)


def _str_dict(value: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in dict(value).items()}


# --- replies -------------------------------------------------------------------------------------


@attrs.frozen
class Done(Record):
    """The reply of a step that returns nothing."""


@attrs.frozen
class Loaded(Record):
    """How many checkpoint tensors a load (or a whole received stream) handed to the model."""

    tensors: int = attrs.field(converter=int)


@attrs.frozen
class FinalizeReply(Record):
    """What one worker's finalize did (adapters.vllm.worker.FinalizeStats, field for field)."""

    kv_scales_reset: int = attrs.field(converter=int)
    seconds: float = attrs.field(converter=float)
    tensors_loaded: int = attrs.field(converter=int)
    parameters_written: int = attrs.field(converter=int, default=-1)
    unwritten: tuple[str, ...] = attrs.field(converter=tuple_of, default=())
    experts_redone: int = attrs.field(converter=int, default=0)


@attrs.frozen
class FingerprintReply(Record):
    """The storage fingerprint as `StorageFingerprint.to_plain` writes it."""

    rows: tuple[Any, ...] = attrs.field(converter=tuple_of)

    @classmethod
    def of(cls, fingerprint: StorageFingerprint) -> FingerprintReply:
        return cls(fingerprint.to_plain())

    def fingerprint(self) -> StorageFingerprint:
        return StorageFingerprint.from_plain([list(row) for row in self.rows])


@attrs.frozen
class DigestsReply(Record):
    """sha256 of every parameter and buffer, by module path."""

    digests: dict[str, str] = attrs.field(converter=_str_dict)


@attrs.frozen
class LiveWeightsReply(Record):
    """Every parameter and buffer as [dtype, shape, bytes], by module path."""

    tensors: dict[str, Any] = attrs.field(converter=dict)

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> LiveWeightsReply:
        out: dict[str, Any] = {}
        for name, t in tensors.items():
            t = t.detach().cpu().contiguous()
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            out[name] = [str(t.dtype).removeprefix("torch."), list(t.shape), data]
        return cls(out)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, (dtype, shape, data) in self.tensors.items():
            dt = getattr(torch, dtype)
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            out[name] = raw.view(dt).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dt)
        return out


def _float_lists(value: Any) -> dict[str, tuple[float, ...]]:
    return {str(k): tuple(float(x) for x in v) for k, v in dict(value).items()}


@attrs.frozen
class KvScalesReply(Record):
    """Each attention layer's q/k/v/prob scales, by module name."""

    scales: dict[str, tuple[float, ...]] = attrs.field(converter=_float_lists)


# --- requests, one per RPC -------------------------------------------------------------------------


@attrs.frozen
class Begin(Request[Done]):
    """Start vLLM's layerwise reload."""

    METHOD: ClassVar[str] = "rl_refit_begin"
    REPLY: ClassVar[type[Record]] = Done


@attrs.frozen
class Load(Request[Loaded]):
    """Colocated only: one bucket's tensors, by reference (not plain; never leaves the process).

    `retained`: the tensors stay valid and unchanged until the refit ends (Bucket.retained), so
    the worker hands them to vLLM as they are; otherwise it copies them first (the sender reuses
    its buffer as soon as the call returns).
    """

    METHOD: ClassVar[str] = "rl_refit_load"
    REPLY: ClassVar[type[Record]] = Loaded

    tensors: tuple[tuple[str, torch.Tensor], ...] = attrs.field(converter=lambda v: tuple((str(n), t) for n, t in v))
    retained: bool = attrs.field(default=False, converter=bool)


@attrs.frozen
class Finalize(Request[FinalizeReply]):
    """Finalize the reload once, then reset uncalibrated KV-cache scales when asked."""

    METHOD: ClassVar[str] = "rl_refit_finalize"
    REPLY: ClassVar[type[Record]] = FinalizeReply

    reset_kv_scales: bool = attrs.field(converter=bool)


@attrs.frozen
class Abort(Request[Done]):
    """Put the model back together after a failure."""

    METHOD: ClassVar[str] = "rl_refit_abort"
    REPLY: ClassVar[type[Record]] = Done


@attrs.frozen
class DeltaBaseReply(Record):
    """A worker's delta receiver (domain.refit.delta_sync.DeltaBase): the digest of the copy it
    holds (None: none), its host bytes, its last patch's seconds."""

    digest: str | None = attrs.field(converter=lambda v: None if v is None else str(v))
    host_bytes: int = attrs.field(converter=int)
    patch_seconds: float = attrs.field(converter=float)

    @classmethod
    def of(cls, base: DeltaBase) -> DeltaBaseReply:
        return cls(base.digest, base.host_bytes, base.patch_seconds)

    def base(self) -> DeltaBase:
        return DeltaBase(self.digest, self.host_bytes, self.patch_seconds)


@attrs.frozen
class DeltaBaseQuery(Request[DeltaBaseReply]):
    """The worker's delta receiver (the first call turns it on); every worker answers."""

    METHOD: ClassVar[str] = "rl_refit_delta_base"
    REPLY: ClassVar[type[Record]] = DeltaBaseReply


@attrs.frozen
class Fingerprint(Request[FingerprintReply]):
    ACCESS: ClassVar[Access] = Access.READ
    METHOD: ClassVar[str] = "rl_refit_fingerprint"
    REPLY: ClassVar[type[Record]] = FingerprintReply


@attrs.frozen
class Digests(Request[DigestsReply]):
    ACCESS: ClassVar[Access] = Access.READ
    METHOD: ClassVar[str] = "rl_refit_digests"
    REPLY: ClassVar[type[Record]] = DigestsReply


@attrs.frozen
class LiveWeights(Request[LiveWeightsReply]):
    ACCESS: ClassVar[Access] = Access.READ
    METHOD: ClassVar[str] = "rl_refit_live_weights"
    REPLY: ClassVar[type[Record]] = LiveWeightsReply


@attrs.frozen
class KvScales(Request[KvScalesReply]):
    ACCESS: ClassVar[Access] = Access.READ
    METHOD: ClassVar[str] = "rl_refit_kv_scales"
    REPLY: ClassVar[type[Record]] = KvScalesReply


# --- the bench extension's (adapters.vllm.bench_extension: `refit bench engine`'s baselines) ------


@attrs.frozen
class LoraStaged(Record):
    """The modules of a staged adapter (after vLLM's packing of q/k/v and gate/up)."""

    modules: int = attrs.field(converter=int)


@attrs.frozen
class LoraStage(Request[LoraStaged]):
    """Build a LoRA adapter under `adapter_id` from its tensors (a safetensors blob in PEFT's names)
    and its adapter_config; the worker holds it, unserved until a request names the id."""

    METHOD: ClassVar[str] = "rl_refit_lora_stage"
    REPLY: ClassVar[type[Record]] = LoraStaged

    adapter_id: int = attrs.field(converter=int)
    config: dict[str, Any] = attrs.field(converter=dict)
    tensors: bytes = attrs.field(converter=bytes)


@attrs.frozen
class LoraDrop(Request[Done]):
    """Drop the adapter held under `adapter_id` (nothing when none is)."""

    METHOD: ClassVar[str] = "rl_refit_lora_drop"
    REPLY: ClassVar[type[Record]] = Done

    adapter_id: int = attrs.field(converter=int)


@attrs.frozen
class BenchMode(Request[Done]):
    """How the next refits load: `refit` (rl-refit's WorkerRefit) or `load_weights` (the baseline)."""

    METHOD: ClassVar[str] = "rl_refit_bench_mode"
    REPLY: ClassVar[type[Record]] = Done

    mode: str = attrs.field(converter=str)


@attrs.frozen
class Seconds(Record):
    seconds: float = attrs.field(converter=float)


@attrs.frozen
class BenchReload(Request[Seconds]):
    """vLLM's own `reload_weights` from the checkpoint directory `path`; replies its seconds."""

    METHOD: ClassVar[str] = "rl_refit_bench_reload"
    REPLY: ClassVar[type[Record]] = Seconds

    path: str = attrs.field(converter=str)


# --- the attached server's session (adapters.vllm.session; the rl_refit weight-transfer backend) ---


@attrs.frozen
class InfoReply(Record):
    """What a worker of a server is: its rl-refit version, whether it runs the rl_refit backend,
    its rank, the engine's world size, the served model, its quantization method, and whether it
    started from the model's checkpoint or with dummy weights (`load_format=dummy`), where its
    weights live, its quantization scheme (adapters.engine_overrides.quantization_scheme) and its
    KV cache's dtype."""

    version: str = attrs.field(converter=str)
    backend: bool = attrs.field(converter=bool)
    rank: int = attrs.field(converter=int)
    world_size: int = attrs.field(converter=int)
    model: str = attrs.field(converter=str)
    quantization: str | None = attrs.field(converter=lambda v: None if v is None else str(v))
    weights: str = attrs.field(converter=str, default="checkpoint")  # "dummy": started without weights
    device: str = attrs.field(converter=str, default="cpu")  # where the worker's weights live
    scheme: str | None = attrs.field(converter=lambda v: None if v is None else str(v), default=None)
    kv_cache_dtype: str = attrs.field(converter=str, default="auto")


@attrs.frozen
class Info(Request[InfoReply]):
    ACCESS: ClassVar[Access] = Access.READ
    METHOD: ClassVar[str] = "rl_refit_info"
    REPLY: ClassVar[type[Record]] = InfoReply


@attrs.frozen
class ReportReply(Record):
    """The worker session's last refit: its finalize report (a FinalizeReply, plain; None before
    one), the error that failed it (an ErrorReply, plain; None), why the worker is stale (None: it
    serves), how many restores it made, and its phase."""

    finalize: dict[str, Any] | None
    error: dict[str, Any] | None
    stale_reason: str | None
    restores: int = attrs.field(converter=int)
    phase: str = attrs.field(converter=str)


@attrs.frozen
class Report(Request[ReportReply]):
    ACCESS: ClassVar[Access] = Access.READ
    METHOD: ClassVar[str] = "rl_refit_report"
    REPLY: ClassVar[type[Record]] = ReportReply


@attrs.frozen
class Restored(Record):
    """Whether the previous weights are back (False: nothing to restore from; the worker is stale)."""

    restored: bool = attrs.field(converter=bool)


@attrs.frozen
class Restore(Request[Restored]):
    """Put the previous weights back (the session's backup); ends any weight update in progress."""

    ACCESS: ClassVar[Access] = Access.SESSION
    METHOD: ClassVar[str] = "rl_refit_restore"
    REPLY: ClassVar[type[Record]] = Restored

    reason: str = attrs.field(converter=str)


@attrs.frozen
class Commit(Request[Done]):
    """The trainer accepted the finalized refit: it becomes the session's backup."""

    ACCESS: ClassVar[Access] = Access.SESSION
    METHOD: ClassVar[str] = "rl_refit_commit"
    REPLY: ClassVar[type[Record]] = Done


# What rl-refit's worker extension answers, and what the bench's adds (adapters.vllm.bench_extension).
WORKER_REQUESTS: tuple[type[Request[Any]], ...] = (Begin, Load, Finalize, Abort, Fingerprint, Digests, LiveWeights,
                                                   KvScales, DeltaBaseQuery, LoraStage, LoraDrop, Info, Report,
                                                   Restore, Commit)
BENCH_REQUESTS: tuple[type[Request[Any]], ...] = (BenchMode, BenchReload)
REQUESTS = WORKER_REQUESTS + BENCH_REQUESTS


# --- errors --------------------------------------------------------------------------------------

# The error classes that cross as themselves: what a worker's refit steps, its side group and its
# transport raise on purpose, and the builtins vLLM's loaders and torch raise. Rebuilt with the
# worker's message and plain attributes, whatever their constructor takes.
_CROSSING: tuple[type[BaseException], ...] = (
    errors.RefitError, errors.RefitLifecycleError, errors.BucketSequenceError, errors.BucketLayoutError,
    EngineRefitUnsupported, errors.EngineTensorMismatch, errors.EngineStale, errors.EngineBusy,
    errors.EngineUpdateFailed, EngineProcessError, errors.RefitVerificationFailed, errors.RefitIncomplete,
    errors.StorageRebound, errors.InjectedFault, errors.TransportAborted, errors.WireProtocolError,
    errors.CollectiveTimeout, errors.PeerLost, errors.PeerFailed, errors.UnsupportedCombination, errors.ConfigError,
    errors.InvalidTensor, errors.UnsupportedQuantMethod, errors.DeltaBaseMismatch, errors.DeltaRecordError,
    errors.AdapterUpdateFailed, errors.LoraError,
    ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError, NotImplementedError, AssertionError,
    TimeoutError, ConnectionError, OSError, MemoryError, WorkerError, SessionRefused, errors.ServerMismatch, errors.ServerUnreachable,
    errors.SharedMemoryUnavailable,
)
ERRORS: dict[str, type[BaseException]] = {cls.__name__: cls for cls in _CROSSING}


def _is_plain(value: Any) -> bool:
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return True
    if isinstance(value, list | tuple):
        return all(_is_plain(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


@attrs.frozen
class ErrorReply(Record):
    """A worker's error: its type's name, its message and its plain attributes.

    Attributes:
        type: the class name (a key of ERRORS), or `module.qualname` of a type that does not cross.
        message: the error's message (at most MAX_MESSAGE characters).
        details: the error's own attributes that are plain values (CollectiveTimeout's rank, step,
            seconds and peers; RefitIncomplete's unwritten), set again on the rebuilt error.
    """

    type: str = attrs.field(converter=str)
    message: str = attrs.field(converter=str)
    details: dict[str, Any] = attrs.field(converter=dict, factory=dict)

    @classmethod
    def of(cls, err: BaseException) -> ErrorReply:
        """The reply that carries `err`."""
        kind = type(err)
        name = kind.__name__ if ERRORS.get(kind.__name__) is kind else f"{kind.__module__}.{kind.__qualname__}"
        args = err.args
        message = args[0] if len(args) == 1 and isinstance(args[0], str) else str(err)
        details = {k: plain(v) for k, v in vars(err).items() if not k.startswith("_") and _is_plain(v)}
        return cls(name, message[:MAX_MESSAGE], details)

    def rebuild(self) -> BaseException:
        """The error as the worker raised it: the same class (WorkerError for a type not in ERRORS),
        the same message, its plain attributes."""
        cls = ERRORS.get(self.type)
        if cls is None:
            return WorkerError(self.type, self.message)
        err = cls.__new__(cls, self.message)
        BaseException.__init__(err, self.message)  # the message as it was, whatever cls's __init__ formats
        for key, value in self.details.items():
            setattr(err, key, tuple(value) if isinstance(value, list) else value)
        return err


def replies_of(request: Request[R], answers: Sequence[Any]) -> list[R]:
    """Every worker's reply to `request`, from their plain answers; raises the first worker's
    error (rebuilt) when any worker answered with one."""
    if not answers:
        raise errors.WireProtocolError(f"{request.METHOD}: no worker answered")
    for answer in answers:
        if isinstance(answer, Mapping) and answer.get(TAG) == ErrorReply.__name__:
            raise ErrorReply.from_plain(answer).rebuild()
    return [request.REPLY.from_plain(answer) for answer in answers]  # type: ignore[misc]


def reply_of(request: Request[R], answers: Sequence[Any]) -> R:
    """The first worker's reply to `request` (replies_of: any worker's error is raised)."""
    return replies_of(request, answers)[0]


def answer(request_type: type[Q], value: Any, handler: Callable[[Q], Record]) -> dict[str, Any]:
    """The worker side of one RPC: `handler`'s reply to the request in `value`, or the ErrorReply
    of what it raised, as plain values (nothing escapes to vLLM but a reply); JSON-safe
    (`json_safe`) when the request came as JSON text (vLLM's HTTP `/collective_rpc`, which answers
    in JSON)."""
    try:
        out = handler(request_type.from_plain(_unwrap(value))).to_plain()
    except Exception as err:
        traceback.print_exc(file=sys.stderr)  # the worker's log keeps where it was raised
        log.warning("rl-refit worker rpc failed", method=request_type.METHOD, error=f"{type(err).__name__}: {str(err)[:500]}")
        out = ErrorReply.of(err).to_plain()
    return json_safe(out) if isinstance(value, str) else out


_BYTES = "__bytes__"


def json_safe(value: Any) -> Any:
    """Plain values as JSON carries them: bytes as {"__bytes__": base64}."""
    if isinstance(value, bytes | bytearray | memoryview):
        import base64

        return {_BYTES: base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def from_json_safe(value: Any) -> Any:
    """`json_safe`'s inverse."""
    if isinstance(value, Mapping):
        if set(value) == {_BYTES}:
            import base64

            return base64.b64decode(value[_BYTES])
        return {k: from_json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json_safe(v) for v in value]
    return value


TOKEN = "token"  # the key of a request's session token, beside its record's fields


def _unwrap(value: Any) -> Any:
    """A request as a worker receives it: a JSON string over vLLM's HTTP `/collective_rpc` (which
    passes strings only), else the plain dict; its session token (`TOKEN`) set aside."""
    if isinstance(value, str):
        import json

        try:
            value = from_json_safe(json.loads(value))
        except ValueError as err:
            raise errors.WireProtocolError(f"a request that is not JSON: {err}") from err
    if isinstance(value, Mapping) and TOKEN in value:
        value = {k: v for k, v in value.items() if k != TOKEN}
    return value


def token_of(value: Any) -> str | None:
    """The session token a request carries (None: none)."""
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except ValueError:
            return None
    token = value.get(TOKEN) if isinstance(value, Mapping) else None
    return None if token is None else str(token)


def with_token(request: Record, token: str | None) -> dict[str, Any]:
    """`request` as plain values, carrying the session token `token` (None: none)."""
    out = request.to_plain()
    if token is not None:
        out[TOKEN] = token
    return out


@runtime_checkable
class WorkerRpc(Protocol):
    """Workers that answer protocol requests (ExtensionWorkers, AttachedWorkers)."""

    def call(self, request: Request[R]) -> R:
        """The first worker's reply to `request`; raises a worker's error as its own class."""
        ...


class WorkerQueries:
    """The read-only RPCs, over a `call_all` the class defines (every worker's reply)."""

    def call_all(self, request: Request[R]) -> list[R]:
        """Every worker's reply to `request`; raises a worker's error as its own class."""
        raise NotImplementedError

    def call(self, request: Request[R]) -> R:
        """The first worker's reply to `request`; raises any worker's error as its own class."""
        return self.call_all(request)[0]

    def delta_base(self) -> DeltaBase:
        """The workers' delta receivers as one (adapters.vllm.delta.combine); the first call turns
        them on."""
        from adapters.vllm.delta import combine

        return combine([reply.base() for reply in self.call_all(DeltaBaseQuery())])

    def fingerprint(self) -> StorageFingerprint:
        """Pointer, shape, stride and dtype of every parameter and buffer of every worker (with
        several workers, each name is prefixed `worker{i}/`)."""
        prints = [reply.fingerprint() for reply in self.call_all(Fingerprint())]
        if len(prints) == 1:
            return prints[0]
        return StorageFingerprint({f"worker{i}/{name}": entry for i, fp in enumerate(prints)
                                   for name, entry in fp.records.items()})

    def live_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of the first worker (host copies)."""
        return self.call(LiveWeights()).to_tensors()

    def digests(self) -> dict[str, str]:
        """sha256 of every parameter and buffer of every worker (with several workers, each name
        is prefixed `worker{i}/`: a tensor-parallel engine holds one shard per worker)."""
        replies = self.call_all(Digests())
        if len(replies) == 1:
            return dict(replies[0].digests)
        return {f"worker{i}/{name}": d for i, reply in enumerate(replies) for name, d in reply.digests.items()}

    def kv_scales(self) -> dict[str, list[float]]:
        """Each attention layer's q/k/v/prob scales on the first worker."""
        return {k: list(v) for k, v in self.call(KvScales()).scales.items()}

    def lora_stage(self, adapter_id: int, config: Mapping[str, Any], tensors: bytes) -> int:
        """Every worker builds the adapter under `adapter_id` (raises the first worker's error);
        returns the bytes sent (the serialized tensors, which collective_rpc hands every worker)."""
        self.call_all(LoraStage(adapter_id, dict(config), tensors))
        return len(tensors)

    def lora_drop(self, adapter_id: int) -> None:
        """Every worker drops `adapter_id` (raises the first worker's error)."""
        self.call_all(LoraDrop(adapter_id))
