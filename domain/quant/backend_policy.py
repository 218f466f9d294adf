"""Backend policy: which kernels a rollout engine is asked to use
(docs/engines.md#kernel-backends-backend-policy).

A pure function of (engine policy, plan, layout, GPU capability, opt-out) that returns a
BackendDecision: one choice per role (dense Linear layers, routed experts), engine-specific
switches, and the reason for each, in words (what `refit plan` and docs/engines.md show). What
each engine does with each cell of its support table is its own BackendPolicy, written by its
adapter's profile (adapters/<engine>/profile.py); this module holds the decision's types, the
capability gates and the steps every engine shares: BF16 and the opt-out choose nothing,
DeepGEMM is never requested when the GPU's capability is unknown, and the E8M0 rule for FP8 block
weights with FP32 checkpoint scales. Capability gates: FP8 block needs SM90+, MX formats and
NVFP4 need SM100+. The opt-out restores automatic selection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import attrs

from domain.errors import GpuCapabilityTooLow
from domain.keys import key
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
from domain.quant.support import is_engine_native

AUTO = "auto"
DEEP_GEMM = "deep_gemm"
# The oldest GPU (compute capability) that has kernels for each preset.
MIN_CAPABILITY: dict[str, tuple[int, int]] = {
    FP8_BLOCK.name: (9, 0),
    MXFP8.name: (10, 0),
    MXFP4.name: (10, 0),
    NVFP4.name: (10, 0),
}
_ARCH = {(9, 0): "Hopper (SM90)", (10, 0): "Blackwell (SM100)"}
_ROLE_KEY = {role: key("quantization", role) for role in ("linear", "moe")}


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
        engine: the engine's name (rollout.name).
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


def deep_gemm(role: KernelRole, reason: str, cap: tuple[int, int] | None) -> BackendChoice:
    """DeepGEMM for a role, when the GPU's capability is known; else the engine's automatic choice.

    Args:
        role: "linear" or "moe".
        reason: why DeepGEMM, in words.
        cap: the GPU's compute capability, or None when unknown.

    Returns:
        The choice: requesting a kernel the GPU may not have fails at start-up, so only with a
        known capability.
    """
    return BackendChoice(role, DEEP_GEMM, reason) if cap is not None else BackendChoice(role, AUTO, _NO_CAPABILITY)


# An engine's choice for one quantized role: (role, preset, activations, engine-native layout,
# GPU capability) -> the choice.
RoleChooser = Callable[[KernelRole, PrecisionFormat, ActivationScheme, bool, tuple[int, int] | None], BackendChoice]


@attrs.frozen
class BackendPolicy:
    """One engine's backend policy (built by its adapter's profile).

    Attributes:
        engine: the engine's name (rollout.name).
        choose: the choice for one quantized role, opt-out not set (see RoleChooser).
        hopper_e8m0_off: turn DeepGEMM's E8M0 scale packing off for FP8 block weights with FP32
            scales on Hopper (SM90).
        ue8m0_where: the engine code that requantizes FP8 block weights to power-of-two scales
            under DeepGEMM on Blackwell (SM100, SM120), cited in the decision's note.
    """

    engine: str
    choose: RoleChooser
    hopper_e8m0_off: bool = False
    ue8m0_where: str = ""


def _choose(policy: BackendPolicy, role: KernelRole, fmt: PrecisionFormat, act: ActivationScheme, native: bool,
            cap: tuple[int, int] | None, opted_out: bool) -> BackendChoice:
    if not fmt.is_quantized:
        return BackendChoice(role, AUTO, "BF16: nothing quantized to choose a kernel for")
    if opted_out:
        return BackendChoice(role, AUTO, "DeepGEMM opt-out: the engine selects automatically")
    return policy.choose(role, fmt, act, native, cap)


def _fp8_block_w8a8(plan: QuantizationPlan) -> bool:
    return any(f.name == FP8_BLOCK.name and f.scale_encoding is ScaleEncoding.FP32 and a is not ActivationScheme.NONE
               for f, a in ((plan.linear, plan.effective_linear_activation), (plan.moe, plan.effective_moe_activation)))


def _e8m0(policy: BackendPolicy, plan: QuantizationPlan, cap: tuple[int, int] | None) -> tuple[bool | None, list[str]]:
    """DeepGEMM's power-of-two scales: off where the engine's policy says; said where it requantizes anyway."""
    if not _fp8_block_w8a8(plan):
        return None, []
    if cap is None:
        return None, ["GPU capability unknown: the E8M0 rule is not applied; if the engine's own choice runs "
                      "FP8_BLOCK on DeepGEMM with E8M0 scales, it requantizes them to powers of two"]
    if policy.hopper_e8m0_off and cap[0] == 9:
        return False, ["E8M0 scale packing off: Hopper FP8 block with FP32 checkpoint scales (packing would "
                       "round the scales to powers of two)"]
    if cap[0] in (10, 12):
        return None, [f"FP8_BLOCK on SM{cap[0]}{cap[1]}: DeepGEMM requantizes the weights and block scales to "
                      f"power-of-two (UE8M0) scales at load ({policy.ue8m0_where}); the served bytes are not the "
                      "exported ones"]
    return None, []


def decide_backends(
    policy: BackendPolicy,
    plan: QuantizationPlan,
    capability: tuple[int, int] | None = None,
    *,
    opt_out: bool = False,
    layout: str | None = None,
) -> BackendDecision:
    """Choose the kernel backends for a rollout engine.

    Args:
        policy: the engine's backend policy (its adapter profile's).
        plan: the resolved rollout quantization plan.
        capability: the GPU's compute capability (major, minor), or None when unknown (then
            DeepGEMM is never requested).
        opt_out: restore automatic selection everywhere
            (`rollout.engine_kwargs.<engine>.use_deep_gemm: false` or `VERL_ROLLOUT_USE_DEEP_GEMM=0`).
        layout: the resolution's checkpoint layout; None reads it from the plan (scales named
            `weight_scale_inv` are the engine's native Fp8Config layouts).

    Returns:
        The BackendDecision with its reasons. Raises GpuCapabilityTooLow when the GPU lacks the
        kernels of a preset the plan uses.
    """
    notes = check_capability(plan, capability)
    cap = None if capability is None else (int(capability[0]), int(capability[1]))
    native = is_engine_native(layout) if layout is not None else plan.scale_name == "weight_scale_inv"
    linear = _choose(policy, "linear", plan.linear, plan.effective_linear_activation, native, cap, opt_out)
    moe = _choose(policy, "moe", plan.moe, plan.effective_moe_activation, native, cap, opt_out)
    e8m0, e8m0_notes = _e8m0(policy, plan, cap)
    if opt_out and plan.is_quantized:
        notes.append("opt-out: DeepGEMM is not requested; the engine chooses every kernel")
    return BackendDecision(policy.engine, linear, moe, e8m0, cap, opt_out, tuple(notes + e8m0_notes))
