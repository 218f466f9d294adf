"""The reference QAT backend: pure torch, CPU or GPU, numerically the exporter by construction.

`apply` wraps the forward of every module that owns a fake-quantized weight. On each call the
wrapper computes the module's weights with `domain.quant.qat.fake_quantize_tensors` from the current
parameters (the exporter's quantize_stream, decoded; fused groups spread over several modules,
like HF q/k/v, are computed together so that they share the exporter's global scale), puts them
in place of the parameters for the duration of the call, fake-quantizes the inputs per the
plan's activation scheme, and puts the parameters back (also on error). Every scale comes from
the live weights at every forward, so nothing can go stale between optimizer steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import structlog
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from adapters.qat_reference.layouts import INPUT, Layout, select_layout
from domain.errors import QatStateError, QatUnsupportedModel
from domain.quant.formats import ActivationScheme
from domain.quant.plan import QuantizationPlan
from domain.quant.qat import (
    LayerPrecision,
    QatSummary,
    TrainerTensor,
    activation_scheme,
    check_parts,
    fake_quantize_input,
    fake_quantize_tensors,
    fused_units,
)
from domain.quant.qat_checks import layer_tensors, tensor_precision

log = structlog.get_logger()
_INPUT_KWARGS = ("input", "input_", "x", "hidden_states")


@attrs.define(eq=False)
class _Site:
    """One fake-quantized tensor, as its owning module's wrapper uses it."""

    tensor: TrainerTensor
    scheme: ActivationScheme
    site: str
    unit: list[TrainerTensor]


@attrs.define(eq=False)
class _Applied:
    model: torch.nn.Module
    root: torch.nn.Module
    plan: QuantizationPlan
    layout: Layout
    summary: QatSummary
    saved: dict[str, torch.nn.Parameter] = attrs.field(factory=dict)
    wrapped: dict[str, tuple[torch.nn.Module, Callable[..., Any] | None]] = attrs.field(factory=dict)


class _LinearInputs(TorchFunctionMode):
    """Fake-quantizes the input of every F.linear whose weight is (a view of) a registered tensor."""

    def __init__(self, plan: QuantizationPlan, sites: Mapping[int, tuple[ActivationScheme, str]]) -> None:
        super().__init__()
        self.plan = plan
        self.sites = sites
        self.hits: dict[int, int] = dict.fromkeys(sites, 0)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            key = args[1].untyped_storage().data_ptr()
            if key in self.sites:
                scheme, name = self.sites[key]
                self.hits[key] += 1
                args = (fake_quantize_input(self.plan, scheme, args[0], name), *args[1:])
        return func(*args, **kwargs)


@attrs.define
class ReferenceQatBackend:
    """QatBackend in pure torch for torch / transformers modules, Megatron-Core models (one rank)
    and the embedded reference model.

    Attributes:
        layout: "auto" (by the model's type), "torch", "megatron" or "reference".
        name: the backend's name in summaries.
    """

    layout: str = "auto"
    name: str = "reference"
    _applied: _Applied | None = attrs.field(default=None, init=False)

    # --- port ------------------------------------------------------------------------------

    def apply(self, model: torch.nn.Module, plan: QuantizationPlan) -> QatSummary:
        """Wrap every module owning a weight the plan quantizes (see the module docstring)."""
        if self._applied is not None:
            raise QatStateError("QAT is already applied to a model by this backend; call remove() first")
        layout = select_layout(model, self.layout)
        root = layout.root(model)
        layout.check(root)
        layers = layer_tensors(layout.tensors(root))
        for t in layers:
            check_parts(t)
        precision = {t.name: tensor_precision(plan, t) for t in layers}
        quantized = [t for t in layers if precision[t.name].weight != "BF16"]
        units = fused_units(plan, quantized)
        summary = QatSummary(self.name, layers, tuple(precision.values()))
        applied = _Applied(model, root, plan, layout, summary)
        by_module: dict[str, list[_Site]] = {}
        for t in quantized:
            d = plan.decide(t.parts[0].name, t.parts[0].shape)
            site = _Site(t, activation_scheme(plan, d), layout.site(root, t), units[t.name])
            by_module.setdefault(t.module, []).append(site)
        for module_name, sites in by_module.items():
            self._wrap(applied, module_name, sites)
        self._applied = applied
        log.info("qat applied", backend=self.name, layout=layout.name, layers=len(layers), fake_quantized=len(quantized))
        return summary

    def refresh(self, model: torch.nn.Module) -> None:
        """Nothing to bring up to date: every scale is derived from the live weights at each forward."""
        self._require(model)

    def remove(self, model: torch.nn.Module) -> None:
        """Restore every wrapped module's forward. A second call is a no-op."""
        applied = self._applied
        if applied is None:
            return
        if applied.model is not model:
            raise QatStateError("remove() was given another model than the one QAT was applied to")
        for module, previous in applied.wrapped.values():
            if previous is None:
                del module.forward
            else:
                module.forward = previous
        self._applied = None

    def effective_precision(self, model: torch.nn.Module) -> dict[str, LayerPrecision]:
        """The precision each Linear/expert tensor computes with (BF16 for unwrapped modules)."""
        applied = self._require(model)
        out = {}
        for p in applied.summary.precision:
            module = applied.root.get_submodule(p.name.rpartition(".")[0])
            active = "forward" in module.__dict__ and getattr(module.forward, "_qat_backend", None) is self
            out[p.name] = p if active else LayerPrecision(p.name)
        return out

    # --- internals -------------------------------------------------------------------------

    def _require(self, model: torch.nn.Module) -> _Applied:
        if self._applied is None or self._applied.model is not model:
            raise QatStateError("QAT is not applied to this model; call apply(model, plan) first")
        return self._applied

    def _current(self, applied: _Applied, t: TrainerTensor) -> torch.Tensor:
        module = applied.root.get_submodule(t.module)
        p = module._parameters[t.param]
        return p if isinstance(p, torch.nn.Parameter) else applied.saved[t.name]

    def _wrap(self, applied: _Applied, module_name: str, sites: list[_Site]) -> None:
        module = applied.root.get_submodule(module_name)
        previous = module.__dict__.get("forward")
        inner = module.forward
        input_sites = [s for s in sites if s.site == INPUT]
        if len({s.scheme for s in input_sites}) > 1:
            raise QatUnsupportedModel(
                f"module {module_name!r} owns weights with different activation schemes "
                f"({sorted(s.scheme.value for s in input_sites)}) on one input"
            )
        units = list({id(s.unit): s.unit for s in sites}.values())

        def forward(*args: Any, **kwargs: Any) -> Any:
            fq: dict[str, torch.Tensor] = {}
            for unit in units:
                values = fake_quantize_tensors(applied.plan, [(t, self._current(applied, t)) for t in unit])
                fq.update({t.name: v for t, v in zip(unit, values, strict=True) if t.module == module_name})
            if input_sites and input_sites[0].scheme is not ActivationScheme.NONE:
                args, kwargs = _quantize_first_input(applied.plan, input_sites[0], module_name, args, kwargs)
            saved = {}
            for s in sites:
                saved[s.tensor.name] = module._parameters[s.tensor.param]
                applied.saved[s.tensor.name] = saved[s.tensor.name]  # type: ignore[assignment]
                module._parameters[s.tensor.param] = fq[s.tensor.name]  # type: ignore[assignment]
            try:
                linear = {fq[s.tensor.name].untyped_storage().data_ptr(): (s.scheme, s.tensor.name)
                          for s in sites if s.site != INPUT and s.scheme is not ActivationScheme.NONE}
                if not linear:
                    return inner(*args, **kwargs)
                with _LinearInputs(applied.plan, linear) as mode:
                    out = inner(*args, **kwargs)
                _check_reached(mode, module_name, args)
                return out
            finally:
                for name, p in saved.items():
                    module._parameters[name.rpartition(".")[2]] = p
                    applied.saved.pop(name, None)

        forward._qat_backend = self  # type: ignore[attr-defined]
        module.forward = forward
        applied.wrapped[module_name] = (module, previous)


def _quantize_first_input(plan: QuantizationPlan, site: _Site, module_name: str, args: tuple,
                          kwargs: dict) -> tuple[tuple, dict]:
    name = f"{module_name} input"
    if args and isinstance(args[0], torch.Tensor):
        return (fake_quantize_input(plan, site.scheme, args[0], name), *args[1:]), kwargs
    for key in _INPUT_KWARGS:
        if isinstance(kwargs.get(key), torch.Tensor):
            return args, {**kwargs, key: fake_quantize_input(plan, site.scheme, kwargs[key], name)}
    raise QatUnsupportedModel(f"module {module_name!r} was called without a tensor input to fake-quantize")


def _check_reached(mode: _LinearInputs, module_name: str, args: tuple) -> None:
    tokens = next((a.numel() for a in args if isinstance(a, torch.Tensor)), 0)
    missed = [mode.sites[k][1] for k, n in mode.hits.items() if n == 0]
    if tokens and missed:
        raise QatUnsupportedModel(
            f"module {module_name!r}: the inputs of {missed} never reached torch.nn.functional.linear, so "
            "their activations could not be fake-quantized (a fused kernel such as grouped_mm bypasses it); "
            "run the module's eager implementation during QAT (transformers: experts_implementation='eager')"
        )
