"""The error hierarchy. One base class; each error also subclasses the matching builtin.

Messages name the tensor or configuration key and say what to do instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # values of the refit, for the errors that carry them
    from domain.refit.report import RefitReport
    from domain.refit.status import RankStatus


class RefitError(Exception):
    """Base class of every error rl-refit raises on purpose."""


# --- tensors handed to a codec -------------------------------------------------------------


class InvalidTensor(RefitError, ValueError):
    """A tensor cannot be quantized as asked. Carries the tensor's name."""

    def __init__(self, tensor: str, problem: str, fix: str = "") -> None:
        self.tensor = tensor
        self.problem = problem
        self.fix = fix
        text = f"tensor {tensor!r}: {problem}"
        super().__init__(f"{text}; {fix}" if fix else text)


class NonFiniteTensor(InvalidTensor):
    """The tensor holds NaN or Inf values."""


class BlockMisaligned(InvalidTensor):
    """The quantized dimension is not a multiple of the format's block."""


class UnsupportedShape(InvalidTensor):
    """The tensor's rank is not one the format quantizes."""


class UnsupportedDtype(InvalidTensor, TypeError):
    """The tensor's dtype is not a floating type the codecs accept."""


# --- configuration and dispatch ------------------------------------------------------------


class ConfigError(RefitError, ValueError):
    """A configuration key is unknown or has a wrong value. Carries the key."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


class UnsupportedCombination(RefitError, ValueError):
    """Two or more settings cannot work together. Names the keys and what to use instead."""


class UnsupportedQuantMethod(RefitError, NotImplementedError):
    """A quantization method exists but the trainer cannot produce it."""


class NativeRefitUnsupported(UnsupportedQuantMethod):
    """Dispatch rule 1 for refits: the engine would serve a native layout (e.g. GPT-OSS mxfp4) the
    trainer cannot produce, so a refit would send tensors that layout cannot load."""


# --- refit lifecycle -----------------------------------------------------------------------


class RefitLifecycleError(RefitError, RuntimeError):
    """A refit step arrived in a state that does not accept it."""


class BucketSequenceError(RefitLifecycleError):
    """A bucket arrived out of order, twice, or the sequence ended early."""


class StorageRebound(RefitError, RuntimeError):
    """A tensor captured by CUDA graphs changed data pointer, shape, stride or dtype."""


class EngineStale(RefitError, RuntimeError):
    """The engine's weights are not a complete refit; it refuses to serve."""


class RefitFailed(RefitError, RuntimeError):
    """A refit failed; the message says what state the engine was left in. Carries the refit's report."""

    def __init__(self, message: str, *, report: RefitReport) -> None:
        self.report = report
        super().__init__(message)


# --- quantization plans, dispatch rules and export (domain/plan, domain/dispatch, export) ----


class UnknownConfigKey(ConfigError, KeyError):
    """A configuration key that the schema does not know. Lists the valid keys."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return ValueError.__str__(self)


class ConfigTypeError(ConfigError, TypeError):
    """A configuration value has the wrong type."""


class RemovedConfigKey(ConfigError):
    """A configuration key (or a form of its value) that was removed; says what replaced it."""


class ConfigNotHonoured(UnsupportedCombination):
    """A user's compressed-tensors quantization_config has fields the trainer's export cannot honour
    as written. Carries `differences`, one sentence per field."""

    def __init__(self, message: str, differences: tuple[str, ...] = ()) -> None:
        self.differences = differences
        super().__init__(message)


class QatModeMismatch(UnsupportedCombination):
    """Dispatch rule 2: the QAT mode does not match the rollout quantization."""


class NativeLayoutOverride(UnsupportedCombination):
    """Dispatch rule 3: a model whose exporter emits the release layout got an override."""


class QuantizedDeltaSync(UnsupportedCombination):
    """Dispatch rule 4: a quantized rollout with a delta/sharded sync backend or wire format."""


class QatWithTeRecipe(UnsupportedCombination):
    """Dispatch rule 5: QAT together with a Transformer Engine FP8/FP4 training recipe."""


class EngineRejectsQuantization(UnsupportedCombination):
    """Dispatch rules 6 and 7: the rollout engine cannot serve this quantization."""


class EngineCellUnsupported(EngineRejectsQuantization):
    """Dispatch rule 6: one (engine, layout, role, format, activations) cell of the support matrix
    that the pinned engine does not load and run as exported. Carries the cell and the engine's
    reason with its code location."""

    def __init__(self, message: str, *, engine: str, layout: str, role: str, fmt: str, activation: str,
                 reason: str, where: str, instead: str) -> None:
        self.engine = engine
        self.layout = layout
        self.role = role
        self.fmt = fmt
        self.activation = activation
        self.reason = reason
        self.where = where
        self.instead = instead
        super().__init__(message)


class BoundaryLayersMismatch(UnsupportedCombination):
    """Dispatch rule 8: NVFP4 training keeps first/last layers BF16 but the rollout does not."""


class FusedGroupSplit(UnsupportedCombination):
    """An ignore entry keeps only part of a fused group (q/k/v, gate/up) in BF16."""


class NonDivisibleTensors(RefitError, ValueError):
    """Dispatch rule 9: tensors whose K is not a multiple of the format's block."""

    def __init__(self, message: str, tensors: tuple[str, ...] = (), patterns: tuple[str, ...] = ()) -> None:
        self.tensors = tensors
        self.patterns = patterns
        super().__init__(message)


class CheckpointError(RefitError, ValueError):
    """A model directory is not a readable Hugging Face safetensors checkpoint."""


class OutputNotEmpty(RefitError, FileExistsError):
    """`refit export --out DIR` names a non-empty directory and `--force` was not given."""


class OutputProtected(OutputNotEmpty):
    """`refit export --out DIR --force` would replace a directory `--force` never replaces: the
    file-system root, the current directory, the home directory, or one holding either."""


class OutputOverlapsModel(CheckpointError):
    """`refit export --out DIR` is the model directory, inside it or above it (symlinks resolved)."""


class OutputBusy(RefitError, BlockingIOError):
    """Another export to the same `--out` is running (it holds the destination's lock), or the lock's
    owner cannot be proven dead."""


class ForeignLockFile(RefitError, FileExistsError):
    """Where an export keeps its lock (`.NAME.lock` beside `--out`) is something rl-refit did not
    create (a file, a symlink, a directory); it is never removed."""


class OutputChanged(RefitError, FileExistsError):
    """`--out` changed between the export's check and its publish; nothing was replaced."""


class OutputNotWritable(RefitError, OSError):
    """The export could not write its output (permissions, a read-only file system, a full disk)."""


class SourceChanged(CheckpointError):
    """A file of the model changed (size, modification time, or replaced) while it was read."""


class QuantizedSource(CheckpointError):
    """The source checkpoint stores quantized tensors in a layout the export cannot decode."""


class NativeLayoutMismatch(CheckpointError):
    """A checkpoint passed through untouched (its own quantization_config, which the trainer cannot
    produce) holds tensors that are not the layout the config says: BF16 weights under a GPTQ
    config, quantized weights without their scales, another bit width. Carries the tensor's name."""

    def __init__(self, tensor: str, problem: str, fix: str) -> None:
        self.tensor = tensor
        super().__init__(f"tensor {tensor!r} {problem}; {fix}")


# --- refit: buckets, sessions, engines, mismatch metrics (domain/buckets, refit, mismatch) ---


class BucketLayoutError(RefitError, ValueError):
    """A bucket's layout is inconsistent (overlap, wrong size, repeated name, bad bucket size)."""


class EngineTensorMismatch(RefitError, ValueError):
    """A refit tensor has no place in the engine, or the wrong shape or dtype for it."""


class DeltaBaseMismatch(RefitError, ValueError):
    """A delta refit's tensor does not apply: the receiver's copy of it is missing, differs from
    the base the delta was made against, or patches into bytes other than the sender's. The refit
    fails through the normal transaction; the next refit is full."""


class DeltaRecordError(RefitError, ValueError):
    """A delta record is malformed (wrong magic, truncated, inconsistent sizes)."""


class RefitVerificationFailed(RefitError, RuntimeError):
    """The engine's check of the staged weights failed before (or while) committing them."""


class EngineRefitUnsupported(RefitError, NotImplementedError):
    """The engine cannot take this refit in place without serving wrong weights (e.g. vLLM's CPU
    BF16 experts with a padded intermediate size); refused before anything was written."""


class RefitIncomplete(RefitError, RuntimeError):
    """A refit finished but left engine parameters it should have written untouched (they hold
    older weights). Carries their names."""

    def __init__(self, refit_id: int, unwritten: Sequence[str]) -> None:
        self.unwritten = tuple(unwritten)
        shown = ", ".join(self.unwritten[:5]) + (", ..." if len(self.unwritten) > 5 else "")
        super().__init__(
            f"refit {refit_id}: {len(self.unwritten)} engine parameters were never written ({shown}); the "
            "refit stream lacks tensors the engine's model has: export from the model the engine serves"
        )


class ProbeMismatch(RefitVerificationFailed):
    """The post-refit probe: the engine's log-probs on the probe batch differ from the reference
    by more than the plan's bound. The engine is marked stale."""

    def __init__(self, refit_id: int, max_abs_diff: float, bound: float, reference: str) -> None:
        self.max_abs_diff = max_abs_diff
        self.bound = bound
        super().__init__(
            f"refit {refit_id}: the engine's log-probs on the probe batch differ from the {reference} "
            f"by up to {max_abs_diff:.6g} (bound {bound:.6g}); the engine serves other weights than "
            "the trainer sent and refuses to serve until a refit passes the probe"
        )


class EngineProcessError(RefitError, RuntimeError):
    """The engine's process failed to start, died, or broke its control protocol; carries the
    end of its log."""


class InjectedFault(RefitError, RuntimeError):
    """A failure injected on purpose by a fault script (tests, `refit demo --inject-fault`)."""


class EngineBusy(RefitLifecycleError):
    """The engine was asked to serve while a refit is staging or finalizing."""


class MismatchInputError(RefitError, ValueError):
    """Log-probs or masks handed to the mismatch metrics do not fit together."""


# --- packed sequences through GatedDeltaNet (GDN) layers -------------------------------------


class InvalidPackedBoundaries(RefitError, ValueError):
    """Packed-sequence boundaries (`cu_seqlens_q` / `cu_seqlens_q_padded`) are malformed.

    Carries the name of the boundary tensor that failed.
    """

    def __init__(self, name: str, problem: str, fix: str = "") -> None:
        self.name = name
        self.problem = problem
        self.fix = fix
        text = f"packed_seq_params.{name}: {problem}"
        super().__init__(f"{text}; {fix}" if fix else text)


class PackedGdnDeterministic(UnsupportedCombination):
    """Packed (THD) input reached a GDN layer while `deterministic_mode` is on."""


class PackedGdnUnsupported(RefitError, NotImplementedError):
    """Packed input reached a GDN layer in a setting the packed-aware forward cannot run."""


# --- fused log-prob/entropy forward and THD packing -----------------------------------------


class InvalidTemperature(RefitError, ValueError):
    """The sampling temperature is not a finite number above zero."""


class FusedForwardModeError(ConfigError):
    """`actor.fused_forward` (or `VERL_FUSED_USE_OP_HOOK`) holds a value that is not a mode."""


class FusedHookUnavailable(RefitError, RuntimeError):
    """The native `output_processor` hook was required but the model's forward lacks it."""


class FusedForwardUnsupported(RefitError, NotImplementedError):
    """The model uses a feature the fused forward does not handle (named in the message)."""


class MegatronModelUnsupported(RefitError, NotImplementedError):
    """The Megatron model has a layout the adapter cannot name or gather (named in the message)."""


class ThdPackingError(RefitError, ValueError):
    """Sequence lengths or a THD layout cannot be packed or unpacked as asked."""


# --- rollout engine adapters and backend policy (domain/backend_policy, adapters/vllm, sglang) ---


class GpuCapabilityTooLow(UnsupportedCombination):
    """The GPU has no kernels for a preset the rollout plan uses (FP8 block: SM90+; MX, NVFP4: SM100+)."""


class EngineUpdateFailed(RefitError, RuntimeError):
    """The rollout engine reported that a weight-update call failed; carries the engine's message."""


# --- quantization-aware training (domain/qat, adapters/qat_reference, adapters/modelopt) -------


class QatPrecisionMismatch(RefitError, ValueError):
    """After QAT is applied, layers train in another precision than the rollout serves.

    Carries `layers`: (layer, what the plan says, what the model does) for every difference.
    """

    def __init__(self, message: str, layers: tuple[tuple[str, str, str], ...] = ()) -> None:
        self.layers = layers
        super().__init__(message)


class QatNumericsMismatch(RefitError, RuntimeError):
    """A QAT backend's weight fake-quantization is not bit-identical to the exporter's. Names the layer."""

    def __init__(self, layer: str, message: str) -> None:
        self.layer = layer
        super().__init__(f"layer {layer!r}: {message}")


class QatLayoutError(RefitError, ValueError):
    """A trainer tensor cannot be split into the Hugging Face tensors the exporter quantizes."""


class QatStateError(RefitError, RuntimeError):
    """A QAT backend was asked to refresh or remove before apply, or to apply twice."""


class QatUnsupportedModel(RefitError, NotImplementedError):
    """The model has a setting under which QAT cannot reproduce the exporter's bits (named in the message)."""


# --- distributed refit: sharding, bucket transport, collective failures (domain/sharding, transfer) --


class ShardingError(RefitError, ValueError):
    """A parallel layout does not fit the model or the refit world. Carries the tensor or config key."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


class CollectiveTimeout(RefitError, TimeoutError):
    """A collective did not complete in time: a peer is hung or gone. Names the rank and the step.

    `report`: the rank's report of the refit it broke, set by the refit service that was running.
    """

    report: RefitReport | None = None

    def __init__(self, rank: int | None, step: str, seconds: float, peers: tuple[int, ...] = ()) -> None:
        self.rank = rank
        self.step = step
        self.seconds = seconds
        self.peers = peers
        who = f"rank {rank}" if rank is not None else "in-process receiver"
        with_ = f" with ranks {list(peers)}" if peers else ""
        super().__init__(
            f"{who}: timed out after {seconds:g} s at step {step!r}{with_}; a peer is hung or gone "
            "(check its log). The process group is no longer usable: restart the refit world"
        )


class PeerLost(RefitError, ConnectionError):
    """A collective failed because a peer closed its connection (it crashed or exited).

    `report`: the rank's report of the refit it broke, set by the refit service that was running.
    """

    report: RefitReport | None = None


class TransportAborted(RefitError, RuntimeError):
    """The source stopped the bucket stream; the message carries the source's error."""


class PeerFailed(RefitError, RuntimeError):
    """A peer rank failed (its own error says why); this rank stopped the same refit with it."""


class RankFailed(RefitError, RuntimeError):
    """A process of a local world (`refit demo --procs N`, `--trainer megatron`) stopped on a typed
    error of its own; the message names the rank and carries that error."""


class WireProtocolError(RefitError, RuntimeError):
    """A transport message is not the one expected (another refit, a corrupt header): ranks are out of step."""


class DistributedRefitFailed(RefitFailed):
    """Every rank of a distributed refit raises this when any rank failed; the message names the
    failing ranks and steps and what each engine did (kept, restored or stale). Carries this
    rank's report and every rank's final status (the same on every rank)."""

    def __init__(self, message: str, *, report: RefitReport, statuses: Sequence[RankStatus]) -> None:
        self.statuses = tuple(statuses)
        super().__init__(message, report=report)
