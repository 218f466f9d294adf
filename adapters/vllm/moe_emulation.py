"""Emulated MoE experts for vLLM's CPU platform: the expert half of adapters.vllm.cpu_emulation.

vLLM's CPU build computes quantized experts natively only where the CPU has AMX tiles (FP8 block:
`CPUExpertsFp8`, `CPUExpertsFp8W8A8`); for MXFP8 and NVFP4 its only fallbacks are Triton
emulation experts, and Triton has no CPU backend. vLLM picks an expert backend inside the
compressed-tensors MoE method's `__init__` (there is no registry like `register_linear_kernel`),
so this module wraps that one look-up, per format, and only steps in where vLLM's own answer
cannot run on the CPU platform:

| format | wrapped (a global of vLLM's compressed-tensors MoE method module) | vLLM's answer here | answer |
|---|---|---|---|
| FP8_BLOCK | `compressed_tensors_moe_w8a8_fp8.select_fp8_moe_backend` | `NONE` (its CPU backends need AMX) | `TRITON`, `TorchFp8BlockExperts` |
| MXFP8 | `compressed_tensors_moe_w8a8_mxfp8.select_mxfp8_moe_backend` | `EMULATION`, `Mxfp8EmulationTritonExperts` | `EMULATION`, `TorchMxfp8Experts` |
| NVFP4 (weight-only) | `compressed_tensors_moe_w4a4_nvfp4.select_nvfp4_moe_backend` | NotImplementedError (no backend takes W4A16 here) | `EMULATION`, `TorchNvfp4Experts` |
| NVFP4, per-token activations (ModelOpt) | `modelopt.select_nvfp4_moe_backend` | NotImplementedError (no backend takes `nvfp4_per_token` here) | `FLASHINFER_TRTLLM`, `TorchNvfp4PerTokenExperts` |

The backend named is one whose weight conversion vLLM performs as a no-op on these tensors
(`convert_to_fp8_moe_kernel_format` for TRITON and EMULATION; `convert_to_nvfp4_moe_kernel_format`
for EMULATION keeps the packed weights and block scales, and turns the global scales into vLLM's
`1 / global_scale` alphas), so weight creation, loading, `process_weights_after_loading` and the
layerwise reload a refit runs stay vLLM's code, and give the layout vLLM's GPU Triton paths read.
Only the experts class is ours (adapters.vllm.moe_emulation_experts): it dequantizes each routed
expert's weights by their scales and runs the two GEMMs in FP32 (`experts_forward`).

ModelOpt NVFP4 experts with the expert activation override `nvfp4_per_token`
(`ModelOptNvFp4FusedMoE`) accept no backend but FlashInfer TRT-LLM: its `__init__` raises unless
the look-up answers `FLASHINFER_TRTLLM`, the backend vLLM uses on SM100. So the answer names that
backend, and the method's one other global whose work depends on it,
`modelopt.convert_to_nvfp4_moe_kernel_format`, is wrapped too: on the CPU platform, for our
experts, it runs vLLM's own conversion for the `EMULATION` backend, which keeps the packed weights,
block scales and `weight_scale_2` decode scales as loaded (TRT-LLM's would shuffle them for its
cubins with FlashInfer, which the CPU build lacks). Every other step (weight creation, the
per-token method's input scales filled with 1.0, loading, the quant config, the kernel's
prepare/finalize, the layerwise reload) stays vLLM's.

MXFP4 is not steered: `CompressedTensorsW4A4Mxfp4MoEMethod` selects no backend on CPU; it
hard-codes Marlin and repacks the weights for it in `process_weights_after_loading`
(`prepare_moe_fp4_layer_for_marlin`, whose `gptq_marlin_repack` the CPU build lacks), so serving it
would mean replacing vLLM's weight conversion.

Each wrapper is installed by `install` (from `cpu_emulation.install`, with the formats the plugin
emulates: none unless the platform is vLLM's CPU platform) with a backup, and `undo` puts vLLM's
function back; installing twice changes nothing. The wrappers check the platform again when
called. vllm is imported only inside functions; the numerics here (`experts_forward`,
`dequantize_fp8_block`, `dequantize_groups`) are plain torch, tested without vLLM.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import torch

from adapters.vllm.qualname import resolve

# vLLM's logger tree (as cpu_emulation's): its handler and format apply to children of "vllm".
LOGGER = "vllm.rl_refit.moe_emulation"
_CT_MOE = "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
_MODELOPT = "vllm.model_executor.layers.quantization.modelopt"
_EXPERTS = "adapters.vllm.moe_emulation_experts"
# Set on every wrapper this module installs: how `install` recognises its own work.
_MARK = "__rl_refit_moe_emulation__"


@attrs.frozen
class SelectorPatch:
    """One expert-backend look-up this module wraps.

    Attributes:
        format: the rl-refit preset whose experts it concerns (cpu_emulation's format names).
        module: the module whose global the MoE method calls.
        name: that global (vLLM's selector function).
        wrapper: "module:qualname" of the function that, given vLLM's selector, returns the wrapper.
    """

    format: str
    module: str
    name: str
    wrapper: str


PATCHES: tuple[SelectorPatch, ...] = (
    SelectorPatch("FP8_BLOCK", _CT_MOE + "compressed_tensors_moe_w8a8_fp8", "select_fp8_moe_backend",
                  __name__ + ":steer_fp8"),
    SelectorPatch("MXFP8", _CT_MOE + "compressed_tensors_moe_w8a8_mxfp8", "select_mxfp8_moe_backend",
                  __name__ + ":steer_mxfp8"),
    SelectorPatch("NVFP4", _CT_MOE + "compressed_tensors_moe_w4a4_nvfp4", "select_nvfp4_moe_backend",
                  __name__ + ":steer_nvfp4"),
    SelectorPatch("NVFP4", _MODELOPT, "select_nvfp4_moe_backend", __name__ + ":steer_modelopt_nvfp4"),
    SelectorPatch("NVFP4", _MODELOPT, "convert_to_nvfp4_moe_kernel_format", __name__ + ":convert_modelopt_nvfp4"),
)

# (module, name) -> vLLM's function, for every global this process has wrapped.
_ORIGINALS: dict[tuple[str, str], Any] = {}


def install(formats: Iterable[str], patches: tuple[SelectorPatch, ...] = PATCHES) -> list[str]:
    """Wrap the expert-backend look-up of each format in `formats`; idempotent.

    Args:
        formats: the formats the plugin emulates (cpu_emulation.emulated_formats).
        patches: the look-ups known (tests pass their own).

    Returns:
        "module.name" of each look-up now wrapped for `formats`.
    """
    wanted = set(formats)
    done = []
    for patch in patches:
        if patch.format not in wanted:
            continue
        module = importlib.import_module(patch.module)
        current = getattr(module, patch.name)
        if not getattr(current, _MARK, False):
            wrapped = resolve(patch.wrapper)(current)
            setattr(wrapped, _MARK, True)
            _ORIGINALS[(patch.module, patch.name)] = current
            setattr(module, patch.name, wrapped)
        done.append(f"{patch.module.rpartition('.')[2]}.{patch.name}")
    return done


def undo(patches: tuple[SelectorPatch, ...] | None = None) -> list[str]:
    """Put back every function `install` wrapped (of `patches` only, if given), where the wrapper
    is still in place (a later patch of the same global by someone else is left alone).
    Returns "module.name" of each put back."""
    done = []
    only = None if patches is None else {(p.module, p.name) for p in patches}
    for (module_name, name), original in list(_ORIGINALS.items()):
        if only is not None and (module_name, name) not in only:
            continue
        module = sys.modules.get(module_name)
        if module is not None and getattr(getattr(module, name, None), _MARK, False):
            setattr(module, name, original)
            done.append(f"{module_name.rpartition('.')[2]}.{name}")
        del _ORIGINALS[(module_name, name)]
    return done


def installed() -> dict[str, Any]:
    """"module.name" -> vLLM's function, for each look-up wrapped in this process."""
    return {f"{m.rpartition('.')[2]}.{n}": f for (m, n), f in _ORIGINALS.items()}


# --- the wrappers: one per look-up; vllm is imported when one is called ---------------------------


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _fits(experts: type, config: Any, weight_key: Any, activation_key: Any) -> tuple[bool, str | None]:
    """vLLM's own support check (`FusedMoEExperts.is_supported_config`) for our experts class."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk

    fmt = (mk.FusedMoEActivationFormat.BatchedExperts if config.moe_parallel_config.use_batched_activation_format
           else mk.FusedMoEActivationFormat.Standard)
    check: Callable[..., tuple[bool, str | None]] = experts.is_supported_config  # type: ignore[attr-defined]
    return check(experts, config, weight_key, activation_key, fmt)


def _log_choice(fmt: str, backend: Any, experts: type, vllm_answer: str) -> None:
    logging.getLogger(LOGGER).info(
        "rl-refit CPU emulation: %s experts via vLLM's %s backend with %s (vLLM's own answer: %s); "
        "weights, loading and reload stay vLLM's", fmt, backend.value, experts.__name__, vllm_answer)


def steer_fp8(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap `select_fp8_moe_backend`: where vLLM finds no FP8 MoE backend on the CPU platform
    (its CPU ones need AMX), block-quantized experts get TorchFp8BlockExperts on the TRITON backend,
    whose weight conversion is a no-op (the checkpoint's [E, N, K] e4m3 weights and FP32 block scales)."""

    def select_fp8_moe_backend(config: Any, weight_key: Any, activation_key: Any,
                               allow_vllm_cutlass: bool = False) -> tuple[Any, Any]:
        backend, experts = original(config, weight_key, activation_key, allow_vllm_cutlass)
        from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend

        if backend is not Fp8MoeBackend.NONE or not _on_cpu():
            return backend, experts
        ours = resolve(_EXPERTS + ":TorchFp8BlockExperts")
        if not _fits(ours, config, weight_key, activation_key)[0]:
            return backend, experts
        _log_choice("FP8_BLOCK", Fp8MoeBackend.TRITON, ours, "no FP8 MoE backend")
        return Fp8MoeBackend.TRITON, ours

    return select_fp8_moe_backend


def steer_mxfp8(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap `select_mxfp8_moe_backend`: on the CPU platform vLLM answers EMULATION with Triton
    experts; keep the backend (its weight conversion is a no-op) and swap in TorchMxfp8Experts."""

    def select_mxfp8_moe_backend(config: Any) -> tuple[Any, Any]:
        backend, experts = original(config)
        from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts
        from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
        from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp8Dynamic, kMxfp8Static

        if not (backend is Fp8MoeBackend.EMULATION and isinstance(experts, type)
                and issubclass(experts, TritonExperts) and _on_cpu()):
            return backend, experts
        ours = resolve(_EXPERTS + ":TorchMxfp8Experts")
        if not _fits(ours, config, kMxfp8Static, kMxfp8Dynamic)[0]:
            return backend, experts
        _log_choice("MXFP8", backend, ours, f"{backend.value} with {experts.__name__}, Triton")
        return backend, ours

    return select_mxfp8_moe_backend


def steer_nvfp4(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap `select_nvfp4_moe_backend`: where vLLM finds no backend for weight-only NVFP4 experts
    on the CPU platform, answer EMULATION (its conversion keeps the packed weights and block
    scales) with TorchNvfp4Experts. W4A4 keeps vLLM's answer."""

    def select_nvfp4_moe_backend(config: Any, weight_key: Any, activation_key: Any) -> tuple[Any, Any]:
        try:
            return original(config, weight_key, activation_key)
        except NotImplementedError as err:
            if activation_key is not None or not _on_cpu():
                raise
            from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend

            ours = resolve(_EXPERTS + ":TorchNvfp4Experts")
            ok, reason = _fits(ours, config, weight_key, activation_key)
            if not ok:
                raise NotImplementedError(f"{err} (rl-refit's {ours.__name__}: {reason})") from err
            _log_choice("NVFP4 weight-only", NvFp4MoeBackend.EMULATION, ours, str(err))
            return NvFp4MoeBackend.EMULATION, ours

    return select_nvfp4_moe_backend


def steer_modelopt_nvfp4(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ModelOpt's `select_nvfp4_moe_backend`: where vLLM finds no backend for NVFP4 experts
    with per-token NVFP4 activations on the CPU platform, answer FLASHINFER_TRTLLM (the only backend
    `ModelOptNvFp4FusedMoE` accepts for them) with TorchNvfp4PerTokenExperts. Other keys keep
    vLLM's answer."""

    def select_nvfp4_moe_backend(config: Any, weight_key: Any, activation_key: Any) -> tuple[Any, Any]:
        from vllm.model_executor.layers.quantization.utils.quant_utils import kNvfp4DynamicToken

        try:
            return original(config, weight_key, activation_key)
        except NotImplementedError as err:
            if activation_key != kNvfp4DynamicToken or not _on_cpu():
                raise
            from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend

            ours = resolve(_EXPERTS + ":TorchNvfp4PerTokenExperts")
            ok, reason = _fits(ours, config, weight_key, activation_key)
            if not ok:
                raise NotImplementedError(f"{err} (rl-refit's {ours.__name__}: {reason})") from err
            _log_choice("NVFP4 per-token (ModelOpt)", NvFp4MoeBackend.FLASHINFER_TRTLLM, ours, str(err))
            return NvFp4MoeBackend.FLASHINFER_TRTLLM, ours

    return select_nvfp4_moe_backend


def convert_modelopt_nvfp4(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ModelOpt's `convert_to_nvfp4_moe_kernel_format`: on the CPU platform, FLASHINFER_TRTLLM
    can only be steer_modelopt_nvfp4's answer (vLLM's TRT-LLM experts need an SM100 GPU), and its
    experts read the weights as loaded, so vLLM's EMULATION conversion (a no-op on the weights, block
    scales and decode scales) runs instead of TRT-LLM's FlashInfer shuffles."""

    def convert_to_nvfp4_moe_kernel_format(nvfp4_backend: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import NvFp4MoeBackend

        if nvfp4_backend is NvFp4MoeBackend.FLASHINFER_TRTLLM and _on_cpu():
            nvfp4_backend = NvFp4MoeBackend.EMULATION
        return original(nvfp4_backend, *args, **kwargs)

    return convert_to_nvfp4_moe_kernel_format


# --- the numerics (plain torch) --------------------------------------------------------------------


def expand_block_scale(scale: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    """A [ceil(rows/br), ceil(cols/bc)] block scale broadcast to [rows, cols] (edge blocks cropped)."""
    return scale.repeat_interleave(block_rows, dim=0)[:rows].repeat_interleave(block_cols, dim=1)[:, :cols]


def dequantize_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """One expert's FP8 block-quantized [N, K] weight times its [N/bn, K/bk] FP32 scales, in FP32."""
    n, k = weight.shape
    return weight.to(torch.float32) * expand_block_scale(scale.to(torch.float32), n, k, *block)


def dequantize_groups(qdata: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """[M, K] quantized activations times their [M, K/group] scales (one per 1 x group), in FP32."""
    rows, cols = qdata.shape
    return qdata.to(torch.float32) * expand_block_scale(scale.to(torch.float32), rows, cols, 1, group_size)


def experts_forward(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    expert: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                    hidden: Callable[[torch.Tensor], torch.Tensor], *,
                    apply_router_weight_on_input: bool = False) -> torch.Tensor:
    """The routed experts' output for each token, in FP32, the same bits for the same inputs.

    For each expert that tokens are routed to (in ascending id), in FP32: `h = x[rows] @ w13^T`,
    `y = hidden(h) @ w2^T`; each token's outputs are then scaled by their router weights (once,
    unless already applied to the input) and summed over its top-k slots in slot order.

    Args:
        x: [M, K] the first GEMM's input, as the kernel sees it (dequantized if quantized).
        topk_weights: [M, topk] router weights.
        topk_ids: [M, topk] local expert ids; -1 for an expert on another rank (contributes 0).
        expert: local id -> (w13 [N, K], w2 [K_out, N']) in FP32.
        hidden: [T, N] FP32 GEMM1 output -> [T, N'] FP32 second GEMM input (activation, then
            whatever quantization the kernel applies to it).
        apply_router_weight_on_input: the router weights were already applied to `x`.

    Returns:
        [M, K_out] FP32.
    """
    m, topk = topk_ids.shape
    y: torch.Tensor | None = None
    for e in torch.unique(topk_ids).tolist():
        if e < 0:
            continue
        rows, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        w13, w2 = expert(e)
        part = hidden(x[rows].to(torch.float32) @ w13.t()) @ w2.t()
        if y is None:
            y = part.new_zeros((m, topk, part.shape[-1]))
        y[rows, slots] = part
    if y is None:  # nothing routed to this rank's experts
        y = x.new_zeros((m, topk, x.shape[-1]), dtype=torch.float32)
    if not apply_router_weight_on_input:
        y = y * topk_weights.to(torch.float32).unsqueeze(-1)
    return y.sum(dim=1)
