"""ModelOpt QAT backend: the plan as ModelOpt quantizers, applied with `mtq.quantize`.

Each Linear module the plan quantizes gets a weight and an input quantizer configured by exact
name (see `adapters.modelopt.configs`); nothing is calibrated (`algorithm: None`), so every
scale is derived from the live tensors at each forward. Weights of a fused group spread over
several modules (HF q/k/v, gate/up) share the exporter's global scale: the registered backend
computes the group together; with ModelOpt's own NVFP4 kernels, `refresh()` writes the group's
amax into each member's weight quantizer (call it after every optimizer step).

On the first forward of every quantized module a pre-hook compares ModelOpt's weight
fake-quantization with the exporter's decoded values (`domain.quant.qat.fake_quantize_tensors`) bit for
bit and raises QatNumericsMismatch naming the layer when they differ.
"""

from __future__ import annotations

from typing import Any

import attrs
import structlog
import torch

from adapters.modelopt.configs import (
    NATIVE_ORDERS,
    NUMERICS,
    input_attributes,
    preset_of,
    scheme_of,
    weight_attributes,
)
from adapters.qat_reference.layouts import Layout, select_layout
from domain.errors import ConfigError, QatNumericsMismatch, QatStateError, QatUnsupportedModel
from domain.quant.formats import NVFP4, ActivationScheme
from domain.quant.plan import QuantizationPlan
from domain.quant.qat import (
    LayerPrecision,
    QatSummary,
    TrainerTensor,
    fake_quantize_input,
    fake_quantize_tensors,
    fused_units,
    straight_through,
)
from domain.quant.qat_checks import layer_tensors, tensor_precision

try:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import (
        register_quant_backend,
        unregister_quant_backend,
    )
except ModuleNotFoundError as err:  # pragma: no cover - exercised only without nvidia-modelopt
    raise ModuleNotFoundError(
        "ModelOptQatBackend needs nvidia-modelopt (the `modelopt` extra)", name=err.name or "modelopt"
    ) from err

log = structlog.get_logger()


@attrs.define(eq=False)
class _State:
    model: torch.nn.Module
    root: torch.nn.Module
    plan: QuantizationPlan
    layout: Layout
    layers: tuple[TrainerTensor, ...]
    units: dict[str, list[TrainerTensor]]
    backend: str
    hooks: list[Any] = attrs.field(factory=list)

    @property
    def by_name(self) -> dict[str, TrainerTensor]:
        return {t.name: t for t in self.layers}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@attrs.define
class ModelOptQatBackend:
    """QatBackend over nvidia-modelopt, for torch / transformers Linear modules and Megatron models.

    Attributes:
        numerics: "exporter" (weights and per-token/1x128 inputs run the exporter's codec inside
            ModelOpt's quantizers; bit-identical by construction, on CPU or GPU) or "modelopt"
            (ModelOpt's own weight kernels and MX input quantizers: FP8 block on CPU or GPU, MX
            and NVFP4 on CUDA; the first-forward check decides whether they may train).
        verify_after_refresh: re-run the bitwise check on the first forward after each refresh.
        layout: the name mapping ("auto", "torch", "megatron").
        name: the backend's name in summaries.
    """

    numerics: str = attrs.field(default="exporter")
    verify_after_refresh: bool = False
    layout: str = "auto"
    name: str = "modelopt"
    _state: _State | None = attrs.field(default=None, init=False)

    @numerics.validator
    def _check_numerics(self, attribute: attrs.Attribute, value: str) -> None:
        if value not in NUMERICS:
            raise ConfigError("ModelOptQatBackend(numerics=...)", f"{value!r} is not one of {', '.join(NUMERICS)}")

    # --- port ------------------------------------------------------------------------------

    def apply(self, model: torch.nn.Module, plan: QuantizationPlan) -> QatSummary:
        """Configure and insert ModelOpt quantizers for the plan; arm the first-forward check."""
        if self._state is not None:
            raise QatStateError("QAT is already applied to a model by this backend; call remove() first")
        layout = select_layout(model, self.layout)
        if layout.name == "reference":
            raise QatUnsupportedModel("the embedded reference model has no Linear modules for ModelOpt; use the "
                                      "reference QAT backend")
        root = layout.root(model)
        layout.check(root)
        layers = layer_tensors(layout.tensors(root))
        precision = {t.name: tensor_precision(plan, t) for t in layers}
        quantized = [t for t in layers if precision[t.name].weight != "BF16"]
        not_weights = [t.name for t in quantized if t.param != "weight"]
        if not_weights:
            raise QatUnsupportedModel(
                f"ModelOpt quantizes module weights; {not_weights} are not (fused 3-D expert tensors); "
                "use the reference QAT backend for this model"
            )
        self._check_device(root, {precision[t.name].weight for t in quantized})
        state = _State(model, root, plan, layout, layers, fused_units(plan, quantized), f"rl_refit_qat_{id(self):x}")
        register_quant_backend(state.backend, lambda x, q: self._fake_quant(state, x, q))
        entries: list[dict[str, Any]] = [{"quantizer_name": "*", "enable": False}]
        for t in quantized:
            p = precision[t.name]
            entries.append({"quantizer_name": f"{t.module}.weight_quantizer", "cfg": weight_attributes(
                mtq, p.weight, numerics=self.numerics, backend=state.backend, tensor=t.name)})
            entries.append({"quantizer_name": f"{t.module}.input_quantizer", "cfg": input_attributes(
                mtq, ActivationScheme(p.activation), numerics=self.numerics, backend=state.backend, tensor=t.name)})
        try:
            mtq.quantize(root, {"quant_cfg": entries, "algorithm": None})
        except (RuntimeError, ValueError, KeyError) as err:
            unregister_quant_backend(state.backend)
            raise QatUnsupportedModel(
                f"ModelOpt could not put quantizers on the plan's layers ({err}); ModelOpt converts only the "
                "module classes it knows (nn.Linear, Megatron's parallel linears): use the reference QAT backend"
            ) from err
        self._state = state
        self._set_group_amax(state)
        self._arm_checks(state)
        summary = QatSummary(self.name, layers, tuple(self.effective_precision(model).values()))
        log.info("qat applied", backend=self.name, numerics=self.numerics, layout=layout.name,
                 layers=len(layers), fake_quantized=len(summary.quantized))
        return summary

    def refresh(self, model: torch.nn.Module) -> None:
        """Write each NVFP4 group's amax into its members' weight quantizers (ModelOpt numerics)."""
        state = self._require(model)
        self._set_group_amax(state)
        if self.verify_after_refresh:
            self._arm_checks(state)

    def remove(self, model: torch.nn.Module) -> None:
        """Disable every quantizer and unregister the backend. Modules stay ModelOpt's classes."""
        state = self._state
        if state is None:
            return
        if state.model is not model:
            raise QatStateError("remove() was given another model than the one QAT was applied to")
        for h in state.hooks:
            h.remove()
        mtq.disable_quantizer(state.root, "*")
        unregister_quant_backend(state.backend)
        self._state = None

    def effective_precision(self, model: torch.nn.Module) -> dict[str, LayerPrecision]:
        """Read every Linear/expert tensor's weight and input quantizers back from the model."""
        state = self._require(model)
        out = {}
        for t in state.layers:
            module = state.root.get_submodule(t.module)
            wq = getattr(module, f"{t.param}_quantizer", None)
            iq = getattr(module, "input_quantizer", None)
            weight = self._describe(state, wq, "format", preset_of) if wq is not None else "BF16"
            act = self._describe(state, iq, "scheme", scheme_of) if iq is not None else "none"
            out[t.name] = LayerPrecision(t.name, weight, act)
        return out

    # --- internals -------------------------------------------------------------------------

    def _check_device(self, root: torch.nn.Module, presets: set[str]) -> None:
        cuda_only = sorted(presets - {"FP8_BLOCK"})
        on_cuda = all(p.is_cuda for p in root.parameters())
        if self.numerics == "modelopt" and cuda_only and not on_cuda:
            raise QatUnsupportedModel(
                f"ModelOpt's own {', '.join(cuda_only)} fake-quant kernels run on CUDA only and the model is not "
                "on a CUDA device; move it to the GPU, or use numerics='exporter' (runs anywhere)"
            )

    def _require(self, model: torch.nn.Module) -> _State:
        if self._state is None or self._state.model is not model:
            raise QatStateError("QAT is not applied to this model; call apply(model, plan) first")
        return self._state

    @staticmethod
    def _describe(state: _State, q: Any, key: str, native: Any) -> str:
        if not q.is_enabled:
            return "BF16" if key == "format" else "none"
        if q.backend == state.backend:
            return str(q.backend_extra_args[key])
        return str(native(q.num_bits, q.block_sizes))

    def _current(self, state: _State, t: TrainerTensor) -> torch.Tensor:
        return state.root.get_submodule(t.module)._parameters[t.param]  # type: ignore[return-value]

    def _reference(self, state: _State, t: TrainerTensor, value: torch.Tensor | None = None) -> torch.Tensor:
        unit = state.units[t.name]
        values = fake_quantize_tensors(
            state.plan, [(u, value if (u is t and value is not None) else self._current(state, u)) for u in unit])
        return values[unit.index(t)]

    def _fake_quant(self, state: _State, x: torch.Tensor, quantizer: Any) -> torch.Tensor:
        args = quantizer.backend_extra_args
        tensor = state.by_name[args["tensor"]]
        if args["role"] == "input":
            return fake_quantize_input(state.plan, ActivationScheme(args["scheme"]), x, f"{tensor.module} input")
        return straight_through(x, self._reference(state, tensor, x).detach())

    def _set_group_amax(self, state: _State) -> None:
        if self.numerics != "modelopt":
            return
        for name, unit in state.units.items():
            t = state.by_name[name]
            wq = getattr(state.root.get_submodule(t.module), "weight_quantizer", None)
            if wq is None or not wq.is_enabled or preset_of(wq.num_bits, wq.block_sizes) != NVFP4.name:
                continue
            with torch.no_grad():
                amax = torch.stack([self._current(state, u).detach().abs().amax().float() for u in unit]).amax()
            wq.amax = amax

    def _arm_checks(self, state: _State) -> None:
        for name in state.units:
            self._arm(state, state.by_name[name])

    def _arm(self, state: _State, t: TrainerTensor) -> None:
        handle: dict[str, Any] = {}

        def check(module: torch.nn.Module, args: Any) -> None:
            self._check_bitwise(state, module, t)
            handle["hook"].remove()

        handle["hook"] = state.root.get_submodule(t.module).register_forward_pre_hook(check)
        state.hooks.append(handle["hook"])

    def _check_bitwise(self, state: _State, module: torch.nn.Module, t: TrainerTensor) -> None:
        with torch.no_grad():
            quantizer: Any = getattr(module, "weight_quantizer")  # noqa: B009
            got = quantizer(self._current(state, t))
            want = self._reference(state, t)
        differ = _bits(got) != _bits(want)
        if got.shape != want.shape or got.dtype != want.dtype:
            raise QatNumericsMismatch(t.name, f"ModelOpt's weight fake-quant gave {got.dtype} {tuple(got.shape)}, "
                                              f"the exporter {want.dtype} {tuple(want.shape)}")
        n = int(differ.sum())
        if n:
            first = tuple(int(i) for i in differ.nonzero()[0])
            gap = float((got.float() - want.float()).abs().max())
            order = NATIVE_ORDERS.get(preset_of(quantizer.num_bits, quantizer.block_sizes))
            why = f"; ModelOpt computes {order}" if order and self.numerics == "modelopt" else ""
            raise QatNumericsMismatch(
                t.name,
                f"ModelOpt's weight fake-quantization ({self.numerics} numerics) differs from dequantize(exported "
                f"tensors, {state.plan.numerics.value} rule) in {n} of {differ.numel()} elements (first at {first}: "
                f"{float(got[first])} vs {float(want[first])}; max |diff| {gap:.3e}){why}; training on it would not "
                "train on the bits the rollout serves: use numerics='exporter' (the default) or the reference QAT "
                "backend",
            )
        log.debug("qat weights bit-identical to the exporter", layer=t.name, backend=self.name)
