"""Packed (THD) sequences through the GatedDeltaNet layers of a Megatron model.

`apply_packed_gdn(model)` is what the composition root (`Services.trainer_side.packed_gdn`) runs after the
model is built. It finds
the GDN layers; when there are none it does nothing. When the installed Megatron-Core handles
packed GDN input itself (0.18 and later) it only adds validation hooks; otherwise it installs the
packed-aware forward with kernels for the model's device. Either way the model (each virtual-
pipeline chunk) validates a batch's packed boundaries once, at its entry, so that the layers
read nothing on the host. `remove_packed_gdn` undoes all of it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal, get_args

import attrs
import structlog
import torch

if TYPE_CHECKING:
    from adapters.megatron.gdn_kernels import GdnKernels

log = structlog.get_logger()

# none: no GDN layer; native: Megatron-Core's own packed GDN, validated; patched: rl-refit's forward.
GdnMode = Literal["none", "native", "patched"]


@attrs.frozen
class PackedGdnReport:
    """What `apply_packed_gdn` did: mode, the GDN layers it saw, the kernels, and why."""

    mode: GdnMode = attrs.field(validator=attrs.validators.in_(get_args(GdnMode)))
    layers: tuple[str, ...] = ()
    kernels: str | None = None
    version: str = "unknown"
    reason: str = ""


def _chunks(model: torch.nn.Module | Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    return [model] if isinstance(model, torch.nn.Module) else list(model)


def _device_of(model: torch.nn.Module | Iterable[torch.nn.Module]) -> torch.device:
    for chunk in _chunks(model):
        for parameter in chunk.parameters():
            return parameter.device
    return torch.device("cpu")


def apply_packed_gdn(
    model: torch.nn.Module | Iterable[torch.nn.Module],
    *,
    kernels: str | GdnKernels = "auto",
    force_patch: bool = False,
    gdn_class: type | None = None,
) -> PackedGdnReport:
    """Make the model's GDN layers take packed input safely.

    Args:
        model: the (unwrapped) Megatron model, or its list of virtual-pipeline chunks.
        kernels: "auto" (reference on CPU, fla on CUDA), "reference", "fla", "causal_conv1d",
            or a GdnKernels; used only when the forward is patched.
        force_patch: install the packed-aware forward even on a natively packed-aware
            Megatron-Core (to compare the two; not needed in production).
        gdn_class: the GDN class to look for; default the installed Megatron-Core one.

    Returns:
        A PackedGdnReport.
    """
    from adapters.megatron import gdn

    if gdn_class is None:
        try:
            gdn_class = gdn.megatron_gdn_class()
        except ModuleNotFoundError:
            # Without megatron-core there is no GDN layer to find.
            return PackedGdnReport("none", reason="megatron-core with GatedDeltaNet is not installed")
    layers = tuple(name for name, _ in gdn.find_gdn_layers(model, gdn_class))
    support = gdn.detect_native_packed_gdn(gdn_class)
    if not layers:
        return PackedGdnReport("none", version=support.version, reason="the model has no GatedDeltaNet layer")
    for chunk in _chunks(model):
        gdn.install_batch_validation(chunk)
    if support.native and not force_patch:
        for _, layer in gdn.find_gdn_layers(model, gdn_class):
            gdn.install_packed_validation(layer)
        report = PackedGdnReport("native", layers, None, support.version, support.reason)
    else:
        chosen = gdn.select_kernels(kernels, _device_of(model))
        gdn.patch_gdn_forward(gdn_class, kernels=chosen, force=force_patch)
        report = PackedGdnReport("patched", layers, chosen.name, support.version, support.reason)
    log.info(
        "gdn.packed_ready",
        mode=report.mode,
        layers=len(layers),
        kernels=report.kernels,
        version=report.version,
    )
    return report


def remove_packed_gdn(
    model: torch.nn.Module | Iterable[torch.nn.Module], *, gdn_class: type | None = None
) -> None:
    """Undo `apply_packed_gdn`: remove validation hooks and restore the original forward."""
    from adapters.megatron import gdn

    if gdn_class is None:
        try:
            gdn_class = gdn.megatron_gdn_class()
        except ModuleNotFoundError:
            return
    for _, layer in gdn.find_gdn_layers(model, gdn_class):
        gdn.remove_packed_validation(layer)
    for chunk in _chunks(model):
        gdn.remove_batch_validation(chunk)
    gdn.unpatch_gdn_forward(gdn_class)
