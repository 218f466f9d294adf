"""Packed (THD) sequences through Megatron-Core GatedDeltaNet layers.

- `detect_native_packed_gdn`: does the installed GatedDeltaNet take packed input itself?
  Megatron-Core 0.18 added packed support together with `GatedDeltaNet._resolve_cu_seqlens`;
  the class is probed for that method (which also recognises backports), and the installed
  version is reported alongside.
- Native: nothing is patched. `install_packed_validation` adds a forward pre-hook (torch's own
  hook mechanism) that checks packed input with typed errors before Megatron's asserts.
- Either way `install_batch_validation` adds a forward pre-hook to the model itself: packed
  boundaries built elsewhere (verl builds its own PackedSeqParams) are validated there, once per
  batch, so that no GDN layer reads them on the host.
- Not native: `patch_gdn_forward` (the one monkey patch of this adapter) replaces
  `GatedDeltaNet.forward` by a forward that sends packed calls through
  `gdn_forward.packed_forward` with injected kernels and every other call to the original
  forward, kept as a backup. Idempotent; `unpatch_gdn_forward` restores the original.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs
import structlog
import torch

from adapters.megatron.gdn_forward import (
    BOUNDARIES_ATTR,
    check_packed_input,
    is_packed,
    packed_forward,
    validate_packed_seq_params,
)
from adapters.megatron.gdn_kernels import GdnKernels, select_kernels
from adapters.megatron.version import megatron_core_version

log = structlog.get_logger()

NATIVE_PACKED_GDN_VERSION = (0, 18)
_VALIDATION_HANDLE = "_rl_refit_packed_gdn_validation"
_BATCH_HANDLE = "_rl_refit_packed_batch_validation"


def megatron_gdn_class() -> type:
    """The installed Megatron-Core GatedDeltaNet class."""
    try:
        from megatron.core.ssm.gated_delta_net import GatedDeltaNet
    except ImportError as err:
        raise ModuleNotFoundError(
            "adapters.megatron.gdn needs megatron-core with GatedDeltaNet (the `megatron` extra)",
            name="megatron.core",
        ) from err
    return GatedDeltaNet


@attrs.frozen
class GdnSupport:
    """Whether a GatedDeltaNet class handles packed input itself, and why we think so."""

    native: bool
    version: str
    reason: str


def detect_native_packed_gdn(gdn_class: type | None = None, version: str | None = None) -> GdnSupport:
    """Probe a GatedDeltaNet class for native packed-sequence support.

    Args:
        gdn_class: the class to probe; default the installed Megatron-Core one.
        version: the Megatron-Core version to report; default the installed one.

    Returns:
        GdnSupport(native, version, reason).
    """
    cls = gdn_class if gdn_class is not None else megatron_gdn_class()
    version = version if version is not None else megatron_core_version()
    if callable(getattr(cls, "_resolve_cu_seqlens", None)):
        return GdnSupport(
            True, version, f"{cls.__qualname__} resolves packed boundaries itself (Megatron-Core >= 0.18)"
        )
    return GdnSupport(
        False,
        version,
        f"{cls.__qualname__} has no packed-sequence support (Megatron-Core < 0.18); patch needed",
    )


# --- the forward patch -------------------------------------------------------------------------


@attrs.define
class _Patch:
    own_forward: Callable[..., Any] | None  # the class's own `forward`, None when inherited
    original: Callable[..., Any]  # what `cls.forward` resolved to before the patch
    signature: inspect.Signature
    kernels: GdnKernels


_PATCHES: dict[type, _Patch] = {}


def _record_for(layer: Any) -> _Patch:
    for cls in type(layer).__mro__:
        if cls in _PATCHES:
            return _PATCHES[cls]
    raise RuntimeError(f"{type(layer).__qualname__}: packed GDN forward called on an unpatched class")


def _bound_arguments(
    signature: inspect.Signature, layer: Any, args: tuple, kwargs: dict
) -> dict[str, Any] | None:
    try:
        bound = signature.bind(layer, *args, **kwargs)
    except TypeError:
        return None
    arguments = dict(bound.arguments)
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
    return arguments


def _packed_aware_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    record = _record_for(self)
    arguments = _bound_arguments(record.signature, self, args, kwargs)
    if (
        arguments is None
        or not is_packed(arguments.get("packed_seq_params"))
        or arguments.get("inference_context") is not None
        or arguments.get("inference_params") is not None
    ):
        return record.original(self, *args, **kwargs)
    return packed_forward(self, arguments["hidden_states"], arguments["packed_seq_params"], record.kernels)


def is_gdn_patched(gdn_class: type | None = None) -> bool:
    """True when `gdn_class` (default: the installed one) runs the packed-aware forward."""
    cls = gdn_class if gdn_class is not None else megatron_gdn_class()
    return cls in _PATCHES and cls.__dict__.get("forward") is _packed_aware_forward


def patch_gdn_forward(
    gdn_class: type | None = None, *, kernels: str | GdnKernels = "auto", force: bool = False
) -> bool:
    """Install the packed-aware GatedDeltaNet forward; idempotent.

    Args:
        gdn_class: the class to patch; default the installed Megatron-Core one.
        kernels: kernel set ("auto", "reference", "fla", "causal_conv1d") or a GdnKernels.
            Patching an already patched class only swaps its kernels.
        force: patch even when the class handles packed input natively (tests do this to run
            the packed-aware forward against Megatron-Core's own).

    Returns:
        True when the class runs the packed-aware forward afterwards, False when it was left
        alone because it supports packed input natively.
    """
    cls = gdn_class if gdn_class is not None else megatron_gdn_class()
    chosen = select_kernels(kernels)
    if cls in _PATCHES:
        _PATCHES[cls].kernels = chosen
        return True
    support = detect_native_packed_gdn(cls)
    if support.native and not force:
        log.info("gdn.patch_skipped", gdn_class=cls.__qualname__, reason=support.reason)
        return False
    target: Any = cls
    original = target.forward
    _PATCHES[cls] = _Patch(cls.__dict__.get("forward"), original, inspect.signature(original), chosen)
    target.forward = _packed_aware_forward
    log.info(
        "gdn.patched", gdn_class=cls.__qualname__, kernels=chosen.name, version=support.version, forced=force
    )
    return True


def unpatch_gdn_forward(gdn_class: type | None = None) -> bool:
    """Restore the original GatedDeltaNet forward; idempotent.

    Args:
        gdn_class: the patched class; default the installed Megatron-Core one.

    Returns:
        True when a patch was removed, False when there was none.
    """
    cls = gdn_class if gdn_class is not None else megatron_gdn_class()
    record = _PATCHES.pop(cls, None)
    if record is None:
        return False
    target: Any = cls
    if record.own_forward is None:
        del target.forward
    else:
        target.forward = record.own_forward
    log.info("gdn.unpatched", gdn_class=cls.__qualname__)
    return True


# --- validation on natively packed-aware versions ---------------------------------------------


def _forward_signature(module: Any) -> inspect.Signature:
    for cls in type(module).__mro__:
        if cls in _PATCHES:
            return _PATCHES[cls].signature
    return inspect.signature(type(module).forward)


def _validation_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    arguments = _bound_arguments(_forward_signature(module), module, args, kwargs)
    if arguments is None or "hidden_states" not in arguments:
        return
    if is_packed(arguments.get("packed_seq_params")):
        check_packed_input(module, arguments["hidden_states"], arguments["packed_seq_params"])


def install_packed_validation(layer: torch.nn.Module) -> bool:
    """Validate packed input of a natively packed-aware GDN layer before it runs; idempotent.

    Args:
        layer: a GatedDeltaNet module.

    Returns:
        True when a hook was added, False when the layer already had one.
    """
    if getattr(layer, _VALIDATION_HANDLE, None) is not None:
        return False
    handle = layer.register_forward_pre_hook(_validation_hook, with_kwargs=True)
    object.__setattr__(layer, _VALIDATION_HANDLE, handle)
    return True


def remove_packed_validation(layer: torch.nn.Module) -> bool:
    """Remove the validation hook; returns False when there was none."""
    handle = getattr(layer, _VALIDATION_HANDLE, None)
    if handle is None:
        return False
    handle.remove()
    object.__setattr__(layer, _VALIDATION_HANDLE, None)
    return True


_SIGNATURES: dict[type, inspect.Signature] = {}


def _batch_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    cls = type(module)
    signature = _SIGNATURES.get(cls) or _SIGNATURES.setdefault(cls, inspect.signature(cls.forward))
    arguments = _bound_arguments(signature, module, args, kwargs)
    params = (arguments or kwargs).get("packed_seq_params")
    if is_packed(params) and getattr(params, BOUNDARIES_ATTR, None) is None:
        cp_size = int(getattr(getattr(module, "config", None), "context_parallel_size", 1) or 1)
        validate_packed_seq_params(params, cp_size=cp_size)


def install_batch_validation(model: torch.nn.Module) -> bool:
    """Validate a batch's packed boundaries once at the model's entry; idempotent.

    A forward pre-hook on the model (a GPTModel or a virtual-pipeline chunk): when its forward
    receives a PackedSeqParams that was not validated where it was built, the boundaries are
    read and checked there, once, before any GDN layer runs.

    Args:
        model: the model chunk whose forward takes `packed_seq_params`.

    Returns:
        True when a hook was added, False when the model already had one.
    """
    if getattr(model, _BATCH_HANDLE, None) is not None:
        return False
    handle = model.register_forward_pre_hook(_batch_hook, with_kwargs=True)
    object.__setattr__(model, _BATCH_HANDLE, handle)
    return True


def remove_batch_validation(model: torch.nn.Module) -> bool:
    """Remove the model-level hook; returns False when there was none."""
    handle = getattr(model, _BATCH_HANDLE, None)
    if handle is None:
        return False
    handle.remove()
    object.__setattr__(model, _BATCH_HANDLE, None)
    return True


def find_gdn_layers(
    model: torch.nn.Module | Iterable[torch.nn.Module], gdn_class: type
) -> Iterator[tuple[str, Any]]:
    """(name, module) of every `gdn_class` instance in a model or a list of model chunks."""
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    for index, chunk in enumerate(chunks):
        prefix = "" if len(chunks) == 1 else f"{index}."
        for name, module in chunk.named_modules():
            if isinstance(module, gdn_class):
                yield prefix + name, module
