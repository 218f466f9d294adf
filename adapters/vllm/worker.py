"""The worker side of a vLLM refit: what runs next to the model, inside each vLLM worker.

`WorkerRefit` drives vLLM's layerwise reload on one model: initialize before the first bucket,
`model.load_weights` per bucket with checkpoint-format names, finalize once after the last bucket,
then the KV-cache scale reset. adapters.vllm.extension runs it inside vLLM's workers.

vLLM buffers a layer's tensors *by reference* until the layer is complete, which may be a later
bucket. A bucket the sender reuses as soon as it is acknowledged is therefore copied first; a
retained one (the trainer's own tensors colocated, or a buffer the worker received into and owns)
goes to vLLM as it is: its bytes stay valid until the refit ends, and vLLM's loaders only read
what they are given.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

import attrs
import structlog
import torch

from adapters.vllm.hooks import VllmHooks
from domain.errors import RefitLifecycleError
from domain.refit.delta_sync import DeltaBase, DeltaReceiver
from domain.refit.storage import StorageFingerprint

log = structlog.get_logger()

KV_SCALE_NAMES = ("q_scale", "k_scale", "v_scale", "prob_scale")


def _expected(model: torch.nn.Module, hooks: VllmHooks) -> set[str]:
    """The parameters a full refit writes: every checkpoint-format parameter the reload restored,
    less the KV-cache quantization placeholders of attention layers (q/k/v/prob scales and zero
    points: a checkpoint without a calibrated kv_cache_scheme has none; finalize resets them)."""
    skip = set()
    for name, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        if qm is not None and hooks.is_kv_cache_method(qm):
            skip.add(f"{name}." if name else "")
    return {unwrapped(n) for n, _ in model.named_parameters()
            if n.rpartition(".")[2] not in KV_SCALE_NAMES and not any(n.startswith(p) for p in skip if p)}


def unwrapped(name: str) -> str:
    """A parameter's name without vLLM's LoRA wrapper (`qkv_proj.base_layer.weight` ->
    `qkv_proj.weight`): an engine started with LoRA wraps its layers, and its `load_weights`
    reports the names of the layers it wrapped."""
    return name.replace(".base_layer.", ".")


# Activation scales a scheme may allocate whatever the checkpoint holds: vLLM's NVFP4 expert method
# allocates w13/w2_input_global_scale for weight-only checkpoints too (its W4A16 kernels never read
# them). A checkpoint that carries no tensor of such a kind cannot write one, on a cold start or by
# a refit: those parameters are expected only when the refit sends tensors of their kind.
ACTIVATION_SCALE_KINDS = ("input_global_scale", "input_scale")


def activation_scale_kind(name: str) -> str | None:
    """The activation-scale kind of a parameter or checkpoint tensor name (ACTIVATION_SCALE_KINDS),
    or None for any other tensor."""
    leaf = name.rpartition(".")[2]
    return next((k for k in ACTIVATION_SCALE_KINDS if leaf.endswith(k)), None)


def tied_parameters(model: torch.nn.Module) -> dict[str, str]:
    """Parameters that share another's storage (tied word embeddings): alias name -> the name of
    the parameter it is tied to (the first name the model lists for that storage).

    vLLM ties `lm_head` to `embed_tokens` by making them one Parameter
    (`ParallelLMHead.tie_weights`) and never loads `lm_head.weight`: the tie is read from the
    served model itself, before the layerwise reload restores each layer's parameters on meta
    (separate tensors then).
    """
    first: dict[tuple[object, ...], str] = {}
    ties: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.device.type == "meta" or p.numel() == 0:
            continue
        key = (p.untyped_storage().data_ptr(), p.storage_offset(), tuple(p.shape), tuple(p.stride()), p.dtype)
        if key in first:
            ties[name] = first[key]
        else:
            first[key] = name
    return ties


class FinalizeStats(NamedTuple):
    """What one worker's finalize did (it crosses process boundaries as adapters.vllm.protocol.FinalizeReply).

    Attributes:
        kv_scales_reset: attention layers whose q/k/v/prob scales were reset to 1.0.
        seconds: post-processing time.
        tensors_loaded: checkpoint tensors handed to `load_weights`.
        parameters_written: engine parameters the loads reported writing (-1: the model's
            `load_weights` does not report them).
        unwritten: engine parameters the refit should have written and did not (sorted); a tied
            parameter (`lm_head.weight` of a tied model) counts as written when its tie target is.
        experts_redone: MoE layers whose skipped expert post-processing was redone.
    """

    kv_scales_reset: int
    seconds: float
    tensors_loaded: int
    parameters_written: int = -1
    unwritten: tuple[str, ...] = ()
    experts_redone: int = 0


@attrs.define
class WorkerRefit:
    """One worker's refit of one model through vLLM's layerwise reload.

    Attributes:
        model: the served model (vLLM's `nn.Module`, or a fake shaped like it).
        model_config: vLLM's ModelConfig (finalize needs its dtype for attention layers).
        hooks: vLLM's functions (or fakes).
        device: where clones of received tensors go (default: the model's first parameter's device).
        reset_kv_scales: reset uncalibrated KV-cache scales after finalize.
        delta: the delta receiver (None until `delta_base` is first asked: nothing kept).
    """

    model: torch.nn.Module
    model_config: object
    hooks: VllmHooks
    device: torch.device | None = None
    reset_kv_scales: bool = True
    loading: bool = attrs.field(init=False, default=False)
    tensors_loaded: int = attrs.field(init=False, default=0)
    expected: set[str] = attrs.field(init=False, factory=set)
    written: set[str] | None = attrs.field(init=False, default=None)
    sent_kinds: set[str] = attrs.field(init=False, factory=set)
    ties: dict[str, str] = attrs.field(init=False, factory=dict)
    delta: DeltaReceiver | None = attrs.field(init=False, default=None)

    def __attrs_post_init__(self) -> None:
        if self.device is None:
            first = next(iter(self.model.parameters()), None)
            self.device = first.device if first is not None else torch.device("cpu")

    def begin(self) -> None:
        """Initialize the layerwise reload (kernel tensors kept, loaders deferred)."""
        if self.loading:
            raise RefitLifecycleError("a vLLM refit is already loading on this worker; finalize or abort it first")
        self.hooks.check_experts(self.model)  # refuses before anything is touched
        self.ties = tied_parameters(self.model)  # before the reload puts each layer on meta
        self.hooks.initialize_reload(self.model)
        self.loading = True
        self.tensors_loaded = 0
        self.expected = _expected(self.model, self.hooks)  # checkpoint-format parameters, restored on meta
        self.written = set()
        self.sent_kinds = set()
        if self.delta is not None:
            self.delta.begin()

    def delta_base(self) -> DeltaBase:
        """The delta receiver's copy (domain.refit.delta_sync); the first call turns it on."""
        if self.delta is None:
            self.delta = DeltaReceiver()
        return self.delta.base()

    def load(self, named_tensors: Sequence[tuple[str, torch.Tensor]], retained: bool = False) -> int:
        """Load one bucket's tensors by checkpoint name; returns how many were loaded.

        Args:
            named_tensors: the bucket's (checkpoint name, tensor) pairs.
            retained: the tensors stay valid and unchanged until the refit ends, so vLLM may
                buffer them as they are. False: each is copied first, so that nothing vLLM
                buffers aliases a buffer the sender reuses. A tensor on another device is
                moved either way.
        """
        if not self.loading:
            raise RefitLifecycleError("load before begin: call begin() first")
        if self.delta is not None:  # delta records patched into whole tensors, suffixes removed
            named_tensors = self.delta.receive(named_tensors)
        owned = self.owned(named_tensors, retained)
        self.sent_kinds |= {kind for name, _ in owned if (kind := activation_scale_kind(name)) is not None}
        load_weights = self.model.load_weights  # every vLLM model class defines it
        with self.hooks.load_context():
            loaded = load_weights(owned)  # type: ignore[operator]
        self.tensors_loaded += len(owned)
        if isinstance(loaded, set) and self.written is not None:
            self.written |= {unwrapped(n) for n in loaded}  # the engine parameters these tensors were loaded into
        else:
            self.written = None  # this model's load_weights does not say what it wrote
        return len(owned)

    def owned(self, named_tensors: Sequence[tuple[str, torch.Tensor]], retained: bool) -> list[tuple[str, torch.Tensor]]:
        """The tensors as vLLM may buffer them: on this worker's device, and copied unless
        `retained` (valid and unchanged until the refit ends)."""
        return [(name, t.to(self.device, copy=not retained)) for name, t in named_tensors]

    def finalize(self) -> FinalizeStats:
        """Finalize the reload once, then reset KV-cache scales.

        Returns:
            The attention layers whose scales were reset, the seconds of post-processing and the
            tensors loaded.
        """
        if not self.loading:
            raise RefitLifecycleError("finalize without a loading refit: call begin() first")
        t0 = time.perf_counter()
        try:
            self.hooks.finalize_reload(self.model, self.model_config)
        except BaseException:
            if self.delta is not None:
                self.delta.discard()
            raise
        finally:
            self.loading = False
        if self.delta is not None:
            self.delta.commit()
        self._reprocess_tied_modules()
        written = self.written
        if written is not None:  # tied parameters are one storage: written when any of them is
            ties = {unwrapped(a): unwrapped(t) for a, t in self.ties.items()}
            written = written | {n for alias, target in ties.items() if alias in written or target in written
                                 for n in (alias, target)}
        redone = self.hooks.redo_experts(self.model, written if written is not None else ())
        seconds = time.perf_counter() - t0
        reset = self.reset_uncalibrated_kv_scales() if self.reset_kv_scales else 0
        if written is None:
            return FinalizeStats(reset, seconds, self.tensors_loaded, experts_redone=redone)
        expected = {n for n in self.expected if (kind := activation_scale_kind(n)) is None or kind in self.sent_kinds}
        unwritten = tuple(sorted(expected - written))
        return FinalizeStats(reset, seconds, self.tensors_loaded, len(written & expected), unwritten, redone)

    def _reprocess_tied_modules(self) -> None:
        """Run the post-processing of modules that hold only tied parameters the stream did not
        write (`lm_head` of a tied model): the reload leaves such a module unprocessed, and a
        quant method may keep a copy of its weight outside the parameters (vLLM's CPU
        `dispatch_cpu_unquantized_gemm` packs `lm_head.weight` into the layer's `cpu_linear`), which
        would then serve the previous weights. Parameters are not rebound by it (the storage check
        still holds); where the method keeps no copy it is a no-op."""
        written = self.written if self.written is not None else set()
        done: set[str] = set()
        for alias, target in self.ties.items():
            for name, other in ((alias, target), (target, alias)):
                module_name, other_module = name.rpartition(".")[0], other.rpartition(".")[0]
                if unwrapped(name) in written or module_name == other_module or module_name in done:
                    continue
                module = self.model.get_submodule(module_name)
                qm = getattr(module, "quant_method", None)
                process = getattr(qm, "process_weights_after_loading", None)
                if callable(process) and not self.hooks.is_kv_cache_method(qm):
                    with torch.no_grad():
                        process(module)
                    log.debug("tied module re-processed after the reload", module=module_name, tied_to=other)
                done.add(module_name)

    def abort(self) -> None:
        """Put the model back together after a failure (no-op when not loading).

        vLLM cannot roll back: layers processed before the failure hold the new weights. The
        finalize puts the kept kernel tensors back, so the model is whole (but mixed) again.
        """
        if self.delta is not None:  # patched while loading: not the model's copy any more
            self.delta.discard()
        if not self.loading:
            return
        self.loading = False
        try:
            self.hooks.finalize_reload(self.model, self.model_config)
        except Exception as err:  # the engine is marked stale either way
            log.warning("vllm finalize after a failed refit raised", error=f"{type(err).__name__}: {err}")

    def reset_uncalibrated_kv_scales(self) -> int:
        """q/k/v/prob scales to 1.0 on attention layers with a KV-cache quant method whose config
        has no `kv_cache_scheme` (their scales are loader placeholders, or left from a dummy load).

        Returns:
            The number of attention layers reset.
        """
        count = 0
        with torch.no_grad():  # scales may be grad-requiring Parameters: fill them in place
            for name, layer in self.model.named_modules():
                qm = getattr(layer, "quant_method", None)
                if qm is None or not self.hooks.is_kv_cache_method(qm):
                    continue
                if getattr(getattr(qm, "quant_config", None), "kv_cache_scheme", None) is not None:
                    continue  # calibrated scales from the checkpoint: keep them
                self.hooks.set_default_kv_scales(layer)
                for scale in KV_SCALE_NAMES:
                    t = getattr(layer, scale, None)
                    if isinstance(t, torch.Tensor):
                        t.fill_(1.0)
                log.debug("kv-cache scales reset to 1.0", layer=name)
                count += 1
        return count

    def fingerprint(self) -> StorageFingerprint:
        """Pointer, shape, stride and dtype of every parameter and buffer (what graphs capture)."""
        return StorageFingerprint.of(self.live_weights())

    def live_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of the model, by its module path."""
        tensors: dict[str, torch.Tensor] = dict(self.model.named_parameters())
        tensors.update(self.model.named_buffers())
        return tensors
