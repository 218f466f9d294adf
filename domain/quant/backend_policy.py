"""Backend policy (ARCHITECTURE.md section 5): which kernels a rollout engine is asked to use.

A pure function of (engine, plan, GPU capability, opt-out) that returns a BackendDecision: one
choice per role (dense Linear layers, routed experts), engine-specific switches, and the reason
for each, in words (what `refit plan` and docs/engines.md show).

vLLM: every non-NVFP4 quantized role requests DeepGEMM; MXFP8 Linear has no DeepGEMM kernel and
falls back to the engine's automatic choice; NVFP4 stays on FlashInfer (TRT-LLM kernels for
per-token activations, CUTLASS for static ones). The opt-out restores automatic selection.
On Hopper, FP8 block weights with FP32 checkpoint scales disable DeepGEMM's E8M0 scale packing
(packing would round every scale to a power of two and serve other numbers than training saw).
SGLang: DeepGEMM pinned for FP8/MXFP8/MXFP4 where SGLang has a DeepGEMM runner; NVFP4 left to it.
Capability gates: FP8 block needs SM90+, MX formats and NVFP4 need SM100+.
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
FLASHINFER_TRTLLM = "flashinfer_trtllm"
FLASHINFER_CUTLASS = "flashinfer_cutlass"
POLICY_ENGINES = ("vllm", "sglang")
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


def _vllm_role(role: KernelRole, fmt: PrecisionFormat, act: ActivationScheme, opted_out: bool) -> BackendChoice:
    if not fmt.is_quantized:
        return BackendChoice(role, AUTO, "BF16: nothing quantized to choose a kernel for")
    if opted_out:
        return BackendChoice(role, AUTO, "DeepGEMM opt-out: the engine selects automatically")
    if fmt.name == NVFP4.name:
        if act is ActivationScheme.NVFP4_STATIC:
            return BackendChoice(role, FLASHINFER_CUTLASS, "NVFP4 with static activations: FlashInfer CUTLASS")
        return BackendChoice(role, FLASHINFER_TRTLLM, "NVFP4 with per-token activations: FlashInfer TRT-LLM")
    if role == "linear" and fmt.name == MXFP8.name:
        return BackendChoice(role, AUTO, "MXFP8 Linear has no DeepGEMM kernel: automatic choice")
    return BackendChoice(role, DEEP_GEMM, f"{fmt.name}: DeepGEMM, the kernels training's numerics match")


def _sglang_role(role: KernelRole, fmt: PrecisionFormat, opted_out: bool) -> BackendChoice:
    if not fmt.is_quantized:
        return BackendChoice(role, AUTO, "BF16: nothing quantized to choose a kernel for")
    if opted_out:
        return BackendChoice(role, AUTO, "DeepGEMM opt-out: the engine selects automatically")
    if fmt.name == NVFP4.name:
        return BackendChoice(role, AUTO, "NVFP4: left to SGLang's own selection")
    if role == "linear" and fmt.name == MXFP4.name:
        return BackendChoice(role, AUTO, "MXFP4 Linear: SGLang has no DeepGEMM dense FP4 runner; automatic choice")
    return BackendChoice(role, DEEP_GEMM, f"{fmt.name}: DeepGEMM pinned")


def _e8m0(plan: QuantizationPlan, cap: tuple[int, int] | None) -> tuple[bool | None, list[str]]:
    fp32_block = [f for f in plan.formats if f.name == FP8_BLOCK.name and f.scale_encoding is ScaleEncoding.FP32]
    if not fp32_block:
        return None, []
    if cap is not None and cap[0] == 9:
        return False, ["E8M0 scale packing off: Hopper FP8 block with FP32 checkpoint scales (packing would "
                       "round the scales to powers of two)"]
    return None, []


def decide_backends(
    engine: str,
    plan: QuantizationPlan,
    capability: tuple[int, int] | None = None,
    *,
    opt_out: bool = False,
) -> BackendDecision:
    """Choose the kernel backends for a rollout engine.

    Args:
        engine: "vllm" or "sglang" (rollout.name).
        plan: the resolved rollout quantization plan.
        capability: the GPU's compute capability (major, minor), or None when unknown.
        opt_out: restore automatic selection everywhere
            (`rollout.engine_kwargs.vllm.use_deep_gemm: false` or `VERL_ROLLOUT_USE_DEEP_GEMM=0`).

    Returns:
        The BackendDecision with its reasons. Raises GpuCapabilityTooLow when the GPU lacks the
        kernels of a preset the plan uses, and ConfigError for an engine without a policy.
    """
    if engine not in POLICY_ENGINES:
        raise ConfigError("rollout.name", f"no backend policy for {engine!r}; engines with one: vllm, sglang")
    notes = check_capability(plan, capability)
    cap = None if capability is None else (int(capability[0]), int(capability[1]))
    if engine == "vllm":
        linear = _vllm_role("linear", plan.linear, plan.effective_linear_activation, opt_out)
        moe = _vllm_role("moe", plan.moe, plan.effective_moe_activation, opt_out)
    else:
        linear = _sglang_role("linear", plan.linear, opt_out)
        moe = _sglang_role("moe", plan.moe, opt_out)
    e8m0, e8m0_notes = _e8m0(plan, cap) if engine == "vllm" else (None, [])
    if opt_out and plan.is_quantized:
        notes.append("opt-out: DeepGEMM is not requested; the engine chooses every kernel")
    return BackendDecision(engine, linear, moe, e8m0, cap, opt_out, tuple(notes + e8m0_notes))
