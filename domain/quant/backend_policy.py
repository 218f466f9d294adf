"""Backend policy (ARCHITECTURE.md section 5): which kernels a rollout engine is asked to use.

A pure function of (engine, plan, layout, GPU capability, opt-out) that returns a BackendDecision:
one choice per role (dense Linear layers, routed experts), engine-specific switches, and the
reason for each, in words (what `refit plan` and docs/engines.md show). The choices follow what
the pinned engines' code does with each cell of the support matrix (domain.quant.support):

vLLM: DeepGEMM for FP8 block (W8A8, both roles) and MXFP8 experts, where the engine honours it.
MXFP8 and MXFP4 Linear layers have no DeepGEMM kernel, compressed-tensors MXFP4 experts ignore
`moe_backend` (W4A4) or would compute FP8 1x128 activations under DeepGEMM (W4A8), and NVFP4 is
served weight-only: all automatic. On Hopper, FP8 block weights with FP32 checkpoint scales turn
DeepGEMM's E8M0 scale packing off (packing rounds every scale to a power of two); on Blackwell
DeepGEMM requantizes them to power-of-two scales at load and the decision says so.
SGLang: DeepGEMM for FP8 block Linear layers and for the experts of its native layouts; its
compressed-tensors FP8 experts have no DeepGEMM runner (Triton, automatic) and NVFP4 runs FP4 Marlin.
DeepGEMM is never requested when the GPU's capability is unknown. Capability gates: FP8 block
needs SM90+, MX formats and NVFP4 need SM100+. The opt-out restores automatic selection.
"""

from __future__ import annotations

from typing import Literal, get_args

import attrs

from domain.errors import ConfigError, GpuCapabilityTooLow
from domain.quant.formats import (
    FP8_BLOCK,
    MXFP4,
    MXFP8,
    NVFP4,
    ActivationScheme,
    PrecisionFormat,
    ScaleEncoding,
)
from domain.quant.plan import QuantizationPlan

AUTO = "auto"
DEEP_GEMM = "deep_gemm"
POLICY_ENGINES = ("vllm", "sglang")
# Layouts served through the engine's own Fp8Config (`quant_method: fp8` / `mxfp8`) rather than
# its compressed-tensors schemes (dispatch.layout_for).
NATIVE_LAYOUTS = ("native-fp8", "sglang-mxfp8")
# The oldest GPU (compute capability) that has kernels for each preset.
MIN_CAPABILITY: dict[str, tuple[int, int]] = {
    FP8_BLOCK.name: (9, 0),
    MXFP8.name: (10, 0),
    MXFP4.name: (10, 0),
    NVFP4.name: (10, 0),
}
_ARCH = {(9, 0): "Hopper (SM90)", (10, 0): "Blackwell (SM100)"}
_ROLE_KEY = {"linear": "rollout.quantization.linear", "moe": "rollout.quantization.moe"}


# The two roles a rollout engine picks kernels for: dense Linear layers and routed experts.
KernelRole = Literal["linear", "moe"]


@attrs.frozen
class BackendChoice:
    """The kernel backend asked for one role.

    Attributes:
        role: "linear" (dense Linear layers) or "moe" (routed experts).
        backend: the engine's backend name (`deep_gemm`, `flashinfer_trtllm`, ...) or `auto`.
        reason: why, in words.
    """

    role: KernelRole = attrs.field(validator=attrs.validators.in_(get_args(KernelRole)))
    backend: str
    reason: str

    @property
    def is_auto(self) -> bool:
        return self.backend == AUTO


@attrs.frozen
class BackendDecision:
    """What the policy decided for one engine and plan.

    Attributes:
        engine: "vllm" or "sglang".
        linear: the dense layers' backend.
        moe: the routed experts' backend.
        deep_gemm_e8m0: False when DeepGEMM's E8M0 scale packing must be off; None = engine default.
        capability: the GPU's (major, minor) compute capability the gates checked, or None.
        opted_out: True when automatic selection was requested.
        notes: further reasons (the gates, the opt-out, E8M0), in words.
    """

    engine: str
    linear: BackendChoice
    moe: BackendChoice
    deep_gemm_e8m0: bool | None = None
    capability: tuple[int, int] | None = None
    opted_out: bool = False
    notes: tuple[str, ...] = ()

    @property
    def choices(self) -> tuple[BackendChoice, BackendChoice]:
        return (self.linear, self.moe)

    @property
    def requests_deep_gemm(self) -> bool:
        """True when any role asks for DeepGEMM."""
        return any(c.backend == DEEP_GEMM for c in self.choices)

    def reasons(self) -> list[str]:
        """Every reason, one line each: `linear: deep_gemm (...)`, then the notes."""
        lines = [f"{c.role}: {c.backend} ({c.reason})" for c in self.choices]
        return lines + list(self.notes)


def _arch(cap: tuple[int, int]) -> str:
    return _ARCH.get(cap, f"SM{cap[0]}{cap[1]}")


def check_capability(plan: QuantizationPlan, capability: tuple[int, int] | None) -> list[str]:
    """The capability gates: every preset the plan uses must have kernels on the GPU.

    Args:
        plan: the rollout quantization plan.
        capability: the GPU's compute capability (major, minor); None skips the gates (no GPU
            known, e.g. when validating a configuration on a laptop).

    Returns:
        One note per gate passed. Raises GpuCapabilityTooLow naming the key and the GPU needed.
    """
    if capability is None:
        return ["GPU capability not given: kernel availability not checked"] if plan.is_quantized else []
    cap = (int(capability[0]), int(capability[1]))
    notes = []
    for role, fmt in (("linear", plan.linear), ("moe", plan.moe)):
        need = MIN_CAPABILITY.get(fmt.name)
        if need is None:
            continue
        if cap < need:
            raise GpuCapabilityTooLow(
                f"{_ROLE_KEY[role]} = {fmt.name} needs a {_arch(need)} GPU or newer, but this GPU is "
                f"SM{cap[0]}{cap[1]}; use a newer GPU or choose "
                + ("FP8_BLOCK (SM90+) or null (BF16)" if need > (9, 0) else "null (BF16)")
            )
        notes.append(f"{role} {fmt.name}: SM{cap[0]}{cap[1]} >= {_arch(need)}")
    return notes


_NO_CAPABILITY = "GPU capability unknown: DeepGEMM not requested, the engine selects automatically"


def _deep_gemm(role: KernelRole, reason: str, cap: tuple[int, int] | None) -> BackendChoice:
    # Requesting a kernel the GPU may not have fails at start-up: only with a known capability.
    return BackendChoice(role, DEEP_GEMM, reason) if cap is not None else BackendChoice(role, AUTO, _NO_CAPABILITY)


def _vllm_role(role: KernelRole, fmt: PrecisionFormat, act: ActivationScheme,
               cap: tuple[int, int] | None) -> BackendChoice:
    if fmt.name == FP8_BLOCK.name:
        if act is ActivationScheme.NONE:
            return BackendChoice(role, AUTO, "FP8_BLOCK weight-only (W8A16): DeepGEMM has no W8A16 kernel; vLLM "
                                             "picks Humming or Marlin")
        return _deep_gemm(role, "FP8_BLOCK: DeepGEMM, the kernels training's numerics match", cap)
    if fmt.name == MXFP8.name:
        if role == "moe":
            return _deep_gemm(role, "MXFP8 experts: DeepGEMM (MXFP8 1x32 activations)", cap)
        return BackendChoice(role, AUTO, "MXFP8 Linear has no DeepGEMM kernel: automatic choice")
    if fmt.name == MXFP4.name:
        if role == "linear":
            return BackendChoice(role, AUTO, "MXFP4 Linear has no DeepGEMM kernel: automatic choice (FlashInfer "
                                             "MXFP4 on SM100)")
        if act is ActivationScheme.MXFP8:
            return BackendChoice(role, AUTO, "W4A8 experts: automatic choice puts TRT-LLM MXFP4 x MXFP8 first; "
                                             "DeepGEMM would compute FP8 1x128 activations instead of MXFP8")
        return BackendChoice(role, AUTO, "MXFP4 experts: vLLM ignores moe_backend=deep_gemm here and runs CUTLASS "
                                         "MXFP4 x MXFP4 where the GPU has it")
    return BackendChoice(role, AUTO, f"{fmt.name} weight-only: vLLM's W4A16 kernels (FlashInfer TRT-LLM has none)")


def _sglang_role(role: KernelRole, fmt: PrecisionFormat, native: bool, cap: tuple[int, int] | None) -> BackendChoice:
    if fmt.name == NVFP4.name:
        return BackendChoice(role, AUTO, "NVFP4 weight-only: left to SGLang (FP4 Marlin, FlashInfer for Linear "
                                         "layers on SM100; the expert scheme always runs the Marlin runner)")
    if fmt.name == MXFP4.name or (fmt.name == MXFP8.name and not native):
        return BackendChoice(role, AUTO, f"{fmt.name} as compressed-tensors is not served by SGLang (see the "
                                         "support matrix): nothing requested")
    if role == "moe" and not native:
        return BackendChoice(role, AUTO, "compressed-tensors FP8 experts have no DeepGEMM runner in SGLang: "
                                         "automatic choice (Triton)")
    return _deep_gemm(role, f"{fmt.name}: DeepGEMM pinned", cap)


def _choose(engine: str, role: KernelRole, fmt: PrecisionFormat, act: ActivationScheme, native: bool,
            cap: tuple[int, int] | None, opted_out: bool) -> BackendChoice:
    if not fmt.is_quantized:
        return BackendChoice(role, AUTO, "BF16: nothing quantized to choose a kernel for")
    if opted_out:
        return BackendChoice(role, AUTO, "DeepGEMM opt-out: the engine selects automatically")
    if engine == "vllm":
        return _vllm_role(role, fmt, act, cap)
    return _sglang_role(role, fmt, native, cap)


def _fp8_block_w8a8(plan: QuantizationPlan) -> bool:
    return any(f.name == FP8_BLOCK.name and f.scale_encoding is ScaleEncoding.FP32 and a is not ActivationScheme.NONE
               for f, a in ((plan.linear, plan.effective_linear_activation), (plan.moe, plan.effective_moe_activation)))


def _e8m0(engine: str, plan: QuantizationPlan, cap: tuple[int, int] | None) -> tuple[bool | None, list[str]]:
    """DeepGEMM's power-of-two scales: off on vLLM/Hopper; said where the engine requantizes anyway."""
    if not _fp8_block_w8a8(plan):
        return None, []
    if cap is None:
        return None, ["GPU capability unknown: the E8M0 rule is not applied; if the engine's own choice runs "
                      "FP8_BLOCK on DeepGEMM with E8M0 scales, it requantizes them to powers of two"]
    if engine == "vllm" and cap[0] == 9:
        return False, ["E8M0 scale packing off: Hopper FP8 block with FP32 checkpoint scales (packing would "
                       "round the scales to powers of two)"]
    if cap[0] in (10, 12):
        where = ("vllm 0.33.0 vllm/model_executor/layers/quantization/utils/fp8_utils.py:1213-1214" if engine == "vllm"
                 else "sglang 0.5.23 sglang/srt/layers/quantization/fp8_utils.py:2147-2181")
        return None, [f"FP8_BLOCK on SM{cap[0]}{cap[1]}: DeepGEMM requantizes the weights and block scales to "
                      f"power-of-two (UE8M0) scales at load ({where}); the served bytes are not the exported ones"]
    return None, []


def decide_backends(
    engine: str,
    plan: QuantizationPlan,
    capability: tuple[int, int] | None = None,
    *,
    opt_out: bool = False,
    layout: str | None = None,
) -> BackendDecision:
    """Choose the kernel backends for a rollout engine.

    Args:
        engine: "vllm" or "sglang" (rollout.name).
        plan: the resolved rollout quantization plan.
        capability: the GPU's compute capability (major, minor), or None when unknown (then
            DeepGEMM is never requested).
        opt_out: restore automatic selection everywhere
            (`rollout.engine_kwargs.vllm.use_deep_gemm: false` or `VERL_ROLLOUT_USE_DEEP_GEMM=0`).
        layout: the resolution's checkpoint layout; None reads it from the plan (scales named
            `weight_scale_inv` are the engine's native Fp8Config layouts).

    Returns:
        The BackendDecision with its reasons. Raises GpuCapabilityTooLow when the GPU lacks the
        kernels of a preset the plan uses, and ConfigError for an engine without a policy.
    """
    if engine not in POLICY_ENGINES:
        raise ConfigError("rollout.name", f"no backend policy for {engine!r}; engines with one: vllm, sglang")
    notes = check_capability(plan, capability)
    cap = None if capability is None else (int(capability[0]), int(capability[1]))
    native = layout in NATIVE_LAYOUTS if layout is not None else plan.scale_name == "weight_scale_inv"
    linear = _choose(engine, "linear", plan.linear, plan.effective_linear_activation, native, cap, opt_out)
    moe = _choose(engine, "moe", plan.moe, plan.effective_moe_activation, native, cap, opt_out)
    e8m0, e8m0_notes = _e8m0(engine, plan, cap)
    if opt_out and plan.is_quantized:
        notes.append("opt-out: DeepGEMM is not requested; the engine chooses every kernel")
    return BackendDecision(engine, linear, moe, e8m0, cap, opt_out, tuple(notes + e8m0_notes))
