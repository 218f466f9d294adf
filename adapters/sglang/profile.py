"""The SGLang engine's profile: its pinned release, its support table, its layout choice, its
backend policy and the checks its adapter makes itself.

The support table is read from the pinned SGLang 0.5.23 wheel. SGLang's compressed-tensors config
parses `input_activations` only for formats it lists as activation formats (naive, int, float,
nvfp4-pack and pack-quantized), then picks a scheme per layer (`_get_scheme_from_parts`) or per
expert layer (`get_moe_scheme`). The native layouts go through its Fp8Config (`quant_method: fp8`
with block [128, 128], or `quant_method: mxfp8`).

Backend policy: DeepGEMM for FP8 block Linear layers and for the experts of its native layouts;
its compressed-tensors FP8 experts have no DeepGEMM runner (Triton, automatic) and NVFP4 runs FP4
Marlin.
"""

from __future__ import annotations

from adapters.engine_profile import NATIVE_LAYOUTS, SGLANG_MXFP8, StaticEngineProfile
from domain.errors import EngineRejectsQuantization
from domain.keys import key
from domain.quant.backend_policy import AUTO, BackendChoice, BackendPolicy, KernelRole, deep_gemm
from domain.quant.dispatch_types import EngineDispatch
from domain.quant.formats import FP8_BLOCK, MXFP4, MXFP8, NVFP4, PrecisionFormat
from domain.quant.formats import ActivationScheme as A
from domain.quant.plan import QuantizationPlan
from domain.quant.support import COMPRESSED_TENSORS, NATIVE_FP8, Cell, SupportTable, Verdict, cite

NAME = PACKAGE = "sglang"
# The release the adapter is written and checked against
# (tests/integration/test_engine_conformance.py reads the pinned wheel).
PINNED_SGLANG = "0.5.23"

_Q = "sglang/srt/layers/quantization/"
_SC = _Q + "compressed_tensors/compressed_tensors.py"
_SCH = _Q + "compressed_tensors/schemes/"
_FP8 = _Q + "fp8.py"


def _s(path: str, lines: str) -> str:
    return cite(PACKAGE, PINNED_SGLANG, path, lines)


def _cell(role: str, fmt: str, act: A, layout: str = COMPRESSED_TENSORS) -> Cell:
    return Cell(NAME, layout, role, fmt, act)


_UE8M0_NOTE = ("on Blackwell (SM100, SM120) with DeepGEMM, weights and block scales are requantized to power-of-two "
               "(UE8M0) scales at load (sglang/srt/layers/deep_gemm_wrapper/configurer.py:58-60, "
               "sglang/srt/layers/quantization/fp8_utils.py:2147-2181), so the served bytes are not the exported ones")
_NOT_ACT_FORMAT = (_s(_Q + "compressed_tensors/utils.py", "13-21"), _s(_SC, "371-401"))
_MX_DENSE = ("SGLang has no compressed-tensors scheme for {fmt} Linear layers: {ct} is not one of its activation "
             "formats, so input_activations are never read, and no weight scheme matches: "
             "NotImplementedError('No compressed-tensors compatible scheme was found.') at start-up")
_MX_EXPERTS_MIXED = ("SGLang reads no input_activations for {ct} experts and get_moe_scheme then calls "
                     "_is_dynamic_token_w4a8 on the missing activations: AttributeError at start-up")
_INSTEAD_MX = "use rollout.name=vllm, or on SGLang FP8_BLOCK or NVFP4 weight-only (linear_activation / moe_activation: none)"
_INSTEAD_MXFP8_NATIVE = ("make MXFP8 the plan's only preset (rollout.quantization.linear and moe MXFP8, or one of them "
                         "null): SGLang then gets its native quant_method: mxfp8 layout; or use rollout.name=vllm")

SGLANG_VERDICTS: tuple[Verdict, ...] = (
    # --- dense Linear layers, compressed-tensors ---------------------------------------------------
    Verdict(_cell("linear", "FP8_BLOCK", A.FP8_GROUP_128), True,
            "CompressedTensorsW8A8Fp8: weight e4m3, weight_scale f32 blocks; block-FP8 kernel per "
            "--fp8-gemm-backend",
            (_s(_SC, "804-819"), _s(_SCH + "compressed_tensors_w8a8_fp8.py", "55-62"),
             _s(_SCH + "compressed_tensors_w8a8_fp8.py", "92-137"), _s(_SCH + "compressed_tensors_w8a8_fp8.py", "205-218")),
            note=_UE8M0_NOTE),
    Verdict(_cell("linear", "FP8_BLOCK", A.NONE), False,
            "no weight-only block-FP8 scheme",
            (_s(_SC, "862"), _s(_SC, "563-587")),
            reason="SGLang's weight-only FP8 check admits tensor and channel scales only, so block FP8 without "
                   "input_activations matches no scheme: NotImplementedError at start-up",
            instead="use FP8 activations for FP8_BLOCK (drop rollout.quantization.linear_activation)"),
    *(Verdict(_cell("linear", "MXFP8", act), False, "no compressed-tensors MXFP8 Linear scheme",
              (_s(_SC, "862"), _s(_SC, "753"), *_NOT_ACT_FORMAT),
              reason=_MX_DENSE.format(fmt="MXFP8", ct="mxfp8-quantized"), instead=_INSTEAD_MXFP8_NATIVE)
      for act in (A.MXFP8, A.NONE)),
    *(Verdict(_cell("linear", "MXFP4", act), False, "no compressed-tensors MXFP4 Linear scheme",
              (_s(_SC, "862"), _s(_SC, "753"), *_NOT_ACT_FORMAT),
              reason=_MX_DENSE.format(fmt="MXFP4", ct="mxfp4-pack-quantized"), instead=_INSTEAD_MX)
      for act in (A.MXFP4, A.MXFP8, A.NONE)),
    Verdict(_cell("linear", "NVFP4", A.NVFP4_PER_TOKEN), False,
            "CompressedTensorsW4A4Fp4 with a static input_global_scale",
            (_s(_SCH + "compressed_tensors_w4a4_nvfp4.py", "88-92"), _s(_SCH + "compressed_tensors_w4a4_nvfp4.py", "145"),
             _s(_SC, "757-783")),
            reason="SGLang's compressed-tensors NVFP4 W4A4 scheme (SM100+) quantizes activations with a static "
                   "input_global_scale the trainer does not export, and below SM100 serves the layer weight-only; "
                   "there is no per-token NVFP4 path",
            instead="serve NVFP4 weight-only (rollout.quantization.linear_activation: none), or use another preset"),
    Verdict(_cell("linear", "NVFP4", A.NONE), True,
            "CompressedTensorsW4A16Fp4: weight_packed u8, weight_global_scale f32, weight_scale e4m3; FP4 Marlin "
            "(FlashInfer on SM100)",
            (_s(_SC, "753-755"), _s(_SCH + "compressed_tensors_w4a16_nvfp4.py", "135-192"))),
    # --- routed experts, compressed-tensors --------------------------------------------------------
    Verdict(_cell("moe", "FP8_BLOCK", A.FP8_GROUP_128), True,
            "CompressedTensorsW8A8Fp8MoE: w13_weight/w2_weight e4m3 with block scales; runner from "
            "moe_runner_backend, auto = Triton",
            (_s(_SC, "976-978"), _s(_SCH + "compressed_tensors_w8a8_fp8_moe.py", "341-366"),
             _s(_SCH + "compressed_tensors_w8a8_fp8_moe.py", "378")),
            note="its create_moe_runner builds a runner only for auto (Triton), aiter, triton and flashinfer_trtllm; "
                 "with moe_runner_backend=deep_gemm the first forward fails (self.runner unset), so deep_gemm is "
                 "not requested"),
    Verdict(_cell("moe", "FP8_BLOCK", A.NONE), False,
            "no weight-only FP8 expert scheme",
            (_s(_SC, "994"), _s(_SC, "431-435")),
            reason="get_moe_scheme finds no weight-only FP8 expert scheme and calls _is_dynamic_token_w4a8 on the "
                   "missing input_activations: AttributeError at start-up",
            instead="use FP8 activations for FP8_BLOCK experts (drop rollout.quantization.moe_activation)"),
    *(Verdict(_cell("moe", "MXFP8", act), False, "no compressed-tensors MXFP8 expert scheme",
              (_s(_SC, "994"), *_NOT_ACT_FORMAT, _s(_SC, "431-435")),
              reason=_MX_EXPERTS_MIXED.format(ct="mxfp8-quantized"), instead=_INSTEAD_MXFP8_NATIVE)
      for act in (A.MXFP8, A.NONE)),
    *(Verdict(_cell("moe", "MXFP4", act), False, "Mxfp4MoEMethod (w13_weight / w2_weight) or AttributeError",
              (_s(_Q + "mxfp4.py", "566-608"), _s(_SC, "236-242"), _s(_SC, "676-696"),
               _s("sglang/srt/models/qwen3_moe.py", "1235-1261"), _s(_SC, "994")),
              reason="SGLang serves compressed-tensors MXFP4 experts with its own Mxfp4MoEMethod, whose parameters "
                     "are w13_weight / w2_weight: the exported experts.N.gate_proj.weight_packed match none of them "
                     "and the generic model loaders (Qwen3-MoE, ...) skip them silently; beside another preset "
                     "(mixed precision) get_moe_scheme raises AttributeError instead",
              instead=_INSTEAD_MX)
      for act in (A.MXFP4, A.MXFP8, A.NONE)),
    Verdict(_cell("moe", "NVFP4", A.NVFP4_PER_TOKEN), False,
            "CompressedTensorsW4A4Nvfp4MoE with static input global scales",
            (_s(_SCH + "compressed_tensors_w4a4_nvfp4_moe.py", "146-163"), _s(_SC, "962-977")),
            reason="SGLang's compressed-tensors NVFP4 W4A4 expert scheme (SM100+) allocates static "
                   "w13/w2_input_global_scale the trainer does not export, and below SM100 serves the experts "
                   "weight-only; there is no per-token NVFP4 path",
            instead="serve NVFP4 experts weight-only (rollout.quantization.moe_activation: none), or use another "
                    "preset"),
    Verdict(_cell("moe", "NVFP4", A.NONE), True,
            "CompressedTensorsW4A16Nvfp4MoE: w13/w2_weight_packed u8, w13/w2_weight_scale e4m3, "
            "w13/w2_weight_global_scale f32; always the Marlin runner",
            (_s(_SC, "959-961"), _s(_SCH + "compressed_tensors_w4a16_nvfp4_moe.py", "47-163"))),
    # --- native layouts ------------------------------------------------------------------------------
    Verdict(_cell("linear", "FP8_BLOCK", A.FP8_GROUP_128, NATIVE_FP8), True,
            "Fp8LinearMethod (quant_method: fp8, block [128, 128]): weight e4m3, weight_scale_inv f32 blocks",
            (_s(_FP8, "665-689"),), note=_UE8M0_NOTE),
    Verdict(_cell("moe", "FP8_BLOCK", A.FP8_GROUP_128, NATIVE_FP8), True,
            "Fp8MoEMethod (quant_method: fp8, block [128, 128]): w13_weight/w2_weight e4m3, "
            "w13_weight_scale_inv/w2_weight_scale_inv f32; runners incl. DeepGEMM",
            (_s(_FP8, "1720-1745"), _s(_FP8, "2941-2996")), note=_UE8M0_NOTE),
    Verdict(_cell("linear", "MXFP8", A.MXFP8, SGLANG_MXFP8), True,
            "Fp8LinearMethod with use_mxfp8 (quant_method: mxfp8): weight e4m3, weight_scale_inv u8 [N, K/32]; "
            "MXFP8 dense backend (fp8_gemm_backend=deep_gemm honoured)",
            (_s(_FP8, "345-388"), _s(_FP8, "539-541"), _s(_FP8, "671-689"), _s(_Q + "fp8_utils.py", "834-888")),
            note="needs SM100 (sglang/srt/layers/quantization/fp8.py:329-339)"),
    Verdict(_cell("moe", "MXFP8", A.MXFP8, SGLANG_MXFP8), True,
            "Fp8MoEMethod with use_mxfp8 (quant_method: mxfp8): w13_weight/w2_weight e4m3, "
            "w13_weight_scale_inv/w2_weight_scale_inv u8; runners incl. DeepGEMM",
            (_s(_FP8, "1720-1745"), _s(_FP8, "2941-2996")),
            note="needs SM100 (sglang/srt/layers/quantization/fp8.py:329-339)"),
    *(Verdict(_cell(role, "MXFP8", A.NONE, SGLANG_MXFP8), False, "native MXFP8 is W8A8",
              (_s(_FP8, "671-676"), _s(_FP8, "539-541")),
              reason="SGLang's native MXFP8 layout requires activation_scheme dynamic and quantizes activations to "
                     "MXFP8: there is no weight-only native MXFP8",
              instead="use MXFP8 activations (drop rollout.quantization.linear_activation / moe_activation)")
      for role in ("linear", "moe")),
)


def default_layout(plan: QuantizationPlan) -> str:
    """The layout a plan from rollout.quantization reaches SGLang in: a plan whose only preset is
    MXFP8 in its native `quant_method: mxfp8` layout, everything else as compressed-tensors."""
    if [f.name for f in plan.formats] == [MXFP8.name]:
        return SGLANG_MXFP8
    return COMPRESSED_TENSORS


def check_plan(plan: QuantizationPlan) -> None:
    """The SGLang adapter's own part of EngineSupportMatrix (docs/plan.md#enginesupportmatrix): no
    MXFP8-linear + MXFP4-MoE combination and no per-token NVFP4. `refit plan` applies the whole
    support table (SupportTable.check).

    Args:
        plan: the resolved plan.

    Returns:
        None. Raises EngineRejectsQuantization.
    """
    name = key("rollout", "name")
    if plan.linear.name == MXFP8.name and plan.moe.name == MXFP4.name:
        raise EngineRejectsQuantization(
            f"{name}=sglang does not serve {key('quantization', 'linear')}=MXFP8 with moe=MXFP4; "
            f"use moe=MXFP8 (or linear=null), or {name}=vllm"
        )
    for role, fmt, act in (("linear", plan.linear, plan.effective_linear_activation),
                           ("moe", plan.moe, plan.effective_moe_activation)):
        if fmt.name == NVFP4.name and act is A.NVFP4_PER_TOKEN:
            raise EngineRejectsQuantization(
                f"{name}=sglang has no per-token NVFP4 activation path ({key('quantization', role)}=NVFP4): its "
                "NVFP4 W4A4 schemes quantize activations with a static input_global_scale the trainer does not "
                f"export; serve NVFP4 weight-only ({key('quantization', role + '_activation')}: none) or another "
                "preset"
            )


# --- backend policy ---------------------------------------------------------------------------------


def _role(role: KernelRole, fmt: PrecisionFormat, act: A, native: bool, cap: tuple[int, int] | None) -> BackendChoice:
    if fmt.name == NVFP4.name:
        return BackendChoice(role, AUTO, "NVFP4 weight-only: left to SGLang (FP4 Marlin, FlashInfer for Linear "
                                         "layers on SM100; the expert scheme always runs the Marlin runner)")
    if fmt.name == MXFP4.name or (fmt.name == MXFP8.name and not native):
        return BackendChoice(role, AUTO, f"{fmt.name} as compressed-tensors is not served by SGLang (see the "
                                         "support matrix): nothing requested")
    if role == "moe" and not native:
        return BackendChoice(role, AUTO, "compressed-tensors FP8 experts have no DeepGEMM runner in SGLang: "
                                         "automatic choice (Triton)")
    return deep_gemm(role, f"{fmt.name}: DeepGEMM pinned", cap)


BACKEND_POLICY = BackendPolicy(NAME, _role, ue8m0_where=_s(_Q + "fp8_utils.py", "2147-2181"))

SGLANG = StaticEngineProfile(
    NAME,
    EngineDispatch(NAME, NATIVE_LAYOUTS, default_layout, SupportTable(NAME, PINNED_SGLANG, SGLANG_VERDICTS)),
    package=PACKAGE,
    pinned_version=PINNED_SGLANG,
    backend_policy=BACKEND_POLICY,
    table_layouts={MXFP8.name: (SGLANG_MXFP8,), FP8_BLOCK.name: (NATIVE_FP8,)},
    any_activation_layouts=(SGLANG_MXFP8,),
    adapter_checks=check_plan,
)
