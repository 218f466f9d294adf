"""Fused log-prob/entropy forward for Megatron-Core GPT models: native hook, legacy patch, auto.

- `resolve_fused_forward` decides the mode once, at model build, from a requested mode (a value
  the composition root parsed) and a probe of the real model's bound `forward`; it stores the
  mode on that real model (found through Float16Module / DDP `.module` chains and a
  vision-language model's `language_model`).
- Hook mode: `GPTModel.forward` is untouched. Callers pass `output_processor=` (the callback of
  `make_output_processor`) and `output_processor_context=FusedContext(...)`; Megatron calls the
  callback with keyword arguments, the context as `context=`.
- Legacy mode: `patch_fused_forward` (the one monkey patch of this adapter) replaces the
  model's `forward` by one that runs Megatron's own preprocessing and decoder and then the
  fused computation; callers pass `temperature=`. A backup is kept; `unpatch_fused_forward`
  restores the original exactly. Both are idempotent.

Both modes share `fused_output`: gather sequence-parallel hidden states, pick the output weight
(`output_weight` for tied embeddings, else `output_layer.weight`), run the domain computation.
Non-last pipeline stages return hidden states untouched (Megatron does it in hook mode, the
patched forward does it in legacy mode).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import attrs
import structlog
import torch

try:
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
except ImportError as err:  # pragma: no cover - exercised only without megatron-core
    raise ModuleNotFoundError(
        "adapters.megatron.fused_forward needs megatron-core (the `megatron` extra)", name="megatron.core"
    ) from err

from adapters.distributed.vocab_group import TorchVocabGroup
from adapters.megatron.version import megatron_core_version
from domain.errors import FusedForwardUnsupported, FusedHookUnavailable, InvalidTensor
from domain.forward.fused_logprob import IGNORE_INDEX, fused_logprob_entropy, validate_temperature
from domain.forward.mode import FusedForwardMode, select_fused_forward_mode

log = structlog.get_logger()

MODE_ATTR = "_rl_refit_fused_forward_mode"
BACKUP_ATTR = "_rl_refit_forward_backup"
HOOK_PARAMETERS = ("output_processor", "output_processor_context")
_WRAPPER_ATTRS = ("module", "_orig_mod")  # Float16Module / DDP / FSDP, torch.compile

Gather = Callable[[torch.Tensor, Any], torch.Tensor]


def _positive_temperature(_: object, __: attrs.Attribute, value: float) -> None:
    validate_temperature(value)


@attrs.frozen
class FusedContext:
    """What the fused computation needs besides Megatron's tensors (`output_processor_context`).

    Attributes:
        temperature: logits are divided by it.
        chunk_size: tokens per chunk (None: sized from the vocabulary).
        ignore_index: label value of positions that are not scored.
    """

    temperature: float = attrs.field(default=1.0, validator=_positive_temperature)
    chunk_size: int | None = None
    ignore_index: int = IGNORE_INDEX


def unwrap_model(model: torch.nn.Module) -> tuple[torch.nn.Module, bool]:
    """The real (innermost) language model behind wrappers.

    Args:
        model: a GPTModel, or one wrapped by Float16Module / DDP (`.module` chains),
            torch.compile (`._orig_mod`), or a vision-language model (`.language_model`).

    Returns:
        (real model, whether a `language_model` hop was taken).
    """
    current, via_language_model = model, False
    for _ in range(32):  # wrappers nest a few levels; the bound guards against cycles
        nxt = next(
            (getattr(current, a) for a in _WRAPPER_ATTRS if isinstance(getattr(current, a, None), torch.nn.Module)),
            None,
        )
        if nxt is None and isinstance(getattr(current, "language_model", None), torch.nn.Module):
            nxt, via_language_model = current.language_model, True
        if nxt is None:
            return current, via_language_model
        current = nxt
    raise FusedForwardUnsupported(f"could not unwrap {type(model).__name__}: wrappers nest more than 32 levels")


def forward_has_hook(real: torch.nn.Module) -> bool:
    """Does the model's bound `forward` accept `output_processor` and `output_processor_context`?"""
    params = inspect.signature(real.forward).parameters
    return all(
        name in params and params[name].kind is not inspect.Parameter.VAR_KEYWORD for name in HOOK_PARAMETERS
    )


def stored_mode(model: torch.nn.Module) -> FusedForwardMode | None:
    """The mode decided for this model at build, or None if none was."""
    return getattr(unwrap_model(model)[0], MODE_ATTR, None)


def resolve_fused_forward(
    model: torch.nn.Module,
    requested: FusedForwardMode = FusedForwardMode.AUTO,
    *,
    chunk_size: int | None = None,
    gather: Gather | None = None,
) -> FusedForwardMode:
    """Decide the mode for `model` once; patch the forward when it is LEGACY.

    A model that already has a mode keeps it when `requested` is AUTO or the same mode; an
    explicit different request replaces the earlier decision (undoing a legacy patch first).

    Args:
        model: the model as built (wrappers allowed).
        requested: AUTO, HOOK or LEGACY (the composition root parses the configuration).
        chunk_size: tokens per chunk of the legacy forward's fused computation.
        gather: sequence-parallel gather of the legacy forward (tests pass a seam).

    Returns:
        HOOK or LEGACY, also stored on the real model.

    Raises:
        FusedHookUnavailable: HOOK requested and the forward has no hook parameters.
    """
    real, _ = unwrap_model(model)
    previous = getattr(real, MODE_ATTR, None)
    if previous is not None and requested in (FusedForwardMode.AUTO, previous):
        return previous
    if previous is FusedForwardMode.LEGACY:
        unpatch_fused_forward(real)  # probe the model's own forward, not the patch
    version = megatron_core_version()
    try:
        mode = select_fused_forward_mode(requested, hook_available=forward_has_hook(real), megatron_version=version)
    except FusedHookUnavailable:
        if previous is FusedForwardMode.LEGACY:  # leave the earlier decision as it was
            patch_fused_forward(real, chunk_size=chunk_size, gather=gather)
        raise
    if mode is FusedForwardMode.LEGACY:
        patch_fused_forward(real, chunk_size=chunk_size, gather=gather)
    setattr(real, MODE_ATTR, mode)
    log.bind(model=type(real).__name__, megatron_core=version).info(
        "fused_forward_mode", requested=requested.value, mode=mode.value
    )
    return mode


def default_gather(hidden: torch.Tensor, group: Any) -> torch.Tensor:
    """Megatron's sequence-parallel all-gather (its backward reduce-scatters the gradient)."""
    return tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=group)


def _tp_group(output_layer: Any) -> Any:
    group = getattr(output_layer, "tp_group", None)
    return group if group is not None else parallel_state.get_tensor_model_parallel_group(check_initialized=False)


def fused_output(
    hidden_states: torch.Tensor,
    *,
    output_layer: Any,
    output_weight: torch.Tensor | None,
    labels: torch.Tensor | None,
    config: Any,
    context: FusedContext,
    gather: Gather | None = None,
) -> dict[str, torch.Tensor]:
    """Log-probs and entropy of `labels` from decoder hidden states, without full logits.

    Args:
        hidden_states: [S, B, H] (or [S / tp, B, H] under sequence parallelism).
        output_layer: Megatron's output layer (its weight, bias and tensor-parallel group).
        output_weight: the shared embedding weight when embeddings are tied, else None.
        labels: int [B, S] token ids to score (ignore_index where nothing is scored).
        config: the model's TransformerConfig.
        context: temperature, chunk size, ignore index.
        gather: the sequence-parallel gather (default: Megatron's).

    Returns:
        {"log_probs": float32 [B, S], "entropy": float32 [B, S]}.
    """
    if labels is None:
        raise InvalidTensor("labels", "the fused forward scores labels and got none", "pass labels=[B, S] token ids")
    if getattr(output_layer, "bias", None) is not None:
        raise FusedForwardUnsupported("output_layer has a bias; the fused forward supports bias-free output layers")
    weight = output_weight if output_weight is not None else output_layer.weight
    group = _tp_group(output_layer)
    world = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    sequence_parallel = bool(getattr(config, "sequence_parallel", False))
    if sequence_parallel:
        hidden_states = (gather or default_gather)(hidden_states, group)
    temperature = context.temperature
    if getattr(config, "use_mup", False) and getattr(config, "mup_output_mult", 1.0) != 1.0:
        temperature = temperature / config.mup_output_mult  # Megatron scales logits by the multiplier
    log_probs, entropy = fused_logprob_entropy(
        hidden_states.transpose(0, 1),
        weight,
        labels,
        temperature=temperature,
        chunk_size=context.chunk_size,
        ignore_index=context.ignore_index,
        vocab_group=TorchVocabGroup(group) if world > 1 else None,
        # Under sequence parallelism the gather's backward reduce-scatters the hidden gradient.
        reduce_hidden_grad=not sequence_parallel,
    )
    return {"log_probs": log_probs, "entropy": entropy}


def make_output_processor(*, gather: Gather | None = None) -> Callable[..., dict[str, torch.Tensor]]:
    """The hook-mode callback for `GPTModel.forward(output_processor=...)`.

    Args:
        gather: the sequence-parallel gather (default: Megatron's; tests pass a seam).

    Returns:
        A callable taking Megatron's keyword arguments, with the FusedContext as `context=`.
    """

    def output_processor(
        *,
        hidden_states: torch.Tensor,
        output_layer: Any,
        output_weight: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        context: FusedContext | None = None,
        config: Any = None,
        **_megatron_kwargs: Any,
    ) -> dict[str, torch.Tensor]:
        if not isinstance(context, FusedContext):
            raise TypeError(
                f"output_processor_context must be a FusedContext, got {type(context).__name__}; "
                "pass output_processor_context=FusedContext(temperature=...)"
            )
        return fused_output(
            hidden_states,
            output_layer=output_layer,
            output_weight=output_weight,
            labels=labels,
            config=config,
            context=context,
            gather=gather,
        )

    return output_processor


# --- legacy: the patched forward -----------------------------------------------------------


@attrs.frozen
class _ForwardBackup:
    had_instance_forward: bool
    forward: Any


def is_patched(model: torch.nn.Module) -> bool:
    """Is the real model's forward the legacy fused forward?"""
    return hasattr(unwrap_model(model)[0], BACKUP_ATTR)


def patch_fused_forward(
    model: torch.nn.Module, *, chunk_size: int | None = None, gather: Gather | None = None
) -> bool:
    """Replace the real model's `forward` by the legacy fused forward (keeps a backup).

    The instance's forward is replaced, so other models of the same class are unaffected.

    Args:
        model: the model (wrappers allowed).
        chunk_size: tokens per chunk of the fused computation.
        gather: sequence-parallel gather (default: Megatron's).

    Returns:
        True if it patched now, False if it was already patched.
    """
    real, _ = unwrap_model(model)
    if hasattr(real, BACKUP_ATTR):
        return False
    if not callable(getattr(real, "_preprocess", None)) or not hasattr(real, "decoder"):
        raise FusedForwardUnsupported(
            f"{type(real).__name__} has no `_preprocess`/`decoder` (Megatron-Core "
            f"{megatron_core_version()}); the legacy fused forward needs a GPTModel"
        )
    own = "forward" in vars(real)
    backup = _ForwardBackup(own, vars(real)["forward"] if own else None)
    object.__setattr__(real, BACKUP_ATTR, backup)
    fused = _legacy_forward_factory(chunk_size, gather)
    object.__setattr__(real, "forward", fused.__get__(real, type(real)))
    return True


def unpatch_fused_forward(model: torch.nn.Module) -> bool:
    """Restore the forward saved by `patch_fused_forward`, exactly.

    Returns:
        True if it restored now, False if the model was not patched.
    """
    real, _ = unwrap_model(model)
    backup = vars(real).get(BACKUP_ATTR)
    if backup is None:
        return False
    if backup.had_instance_forward:
        object.__setattr__(real, "forward", backup.forward)
    else:
        del real.__dict__["forward"]
    del real.__dict__[BACKUP_ATTR]
    return True


def _call_with_supported(fn: Callable[..., Any], signature_of: Callable[..., Any], **kwargs: Any) -> Any:
    """Call `fn` with the keyword arguments `signature_of` accepts (they vary across versions)."""
    params = inspect.signature(signature_of).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def _legacy_forward_factory(chunk_size: int | None, gather: Gather | None) -> Callable[..., Any]:
    def fused_forward(
        self: Any,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        decoder_input: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inference_context: Any = None,
        packed_seq_params: Any = None,
        extra_block_kwargs: dict | None = None,
        runtime_gather_output: bool | None = None,
        *,
        inference_params: Any = None,
        loss_mask: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        temperature: float = 1.0,
    ) -> Any:
        context = FusedContext(temperature=temperature, chunk_size=chunk_size)
        inference_context = inference_context if inference_context is not None else inference_params
        pre = _call_with_supported(
            self._preprocess,
            self._preprocess,
            input_ids=input_ids,
            position_ids=position_ids,
            decoder_input=decoder_input,
            inference_context=inference_context,
            packed_seq_params=packed_seq_params,
            padding_mask=padding_mask,
        )
        decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset = pre[:5]
        block_kwargs = dict(
            hidden_states=decoder_input,
            attention_mask=attention_mask,
            inference_context=inference_context,
            rotary_pos_emb=rotary_pos_emb,
            rotary_pos_cos=rotary_pos_cos,
            rotary_pos_sin=rotary_pos_sin,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
        )
        if len(pre) >= 6:
            block_kwargs["padding_mask"] = pre[5]
        if len(pre) >= 7:
            block_kwargs["rotary_pos_cos_sin"] = pre[6]
        hidden_states = _call_with_supported(
            self.decoder, self.decoder.forward, **block_kwargs, **(extra_block_kwargs or {})
        )
        if not self.post_process:
            return hidden_states
        if getattr(self.config, "mtp_num_layers", None):
            raise FusedForwardUnsupported(
                "the legacy fused forward does not run multi-token prediction (mtp_num_layers); "
                "use the native hook (Megatron-Core >= 0.18)"
            )
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        return fused_output(
            hidden_states,
            output_layer=self.output_layer,
            output_weight=output_weight,
            labels=labels,
            config=self.config,
            context=context,
            gather=gather,
        )

    return fused_forward
