"""The vLLM engine's profile: its pinned releases, its support table, its backend policy.

The support table is read from the pinned vLLM 0.33.0 wheel. The compressed-tensors dispatch
picks a scheme from each config group's weights and input activations: dense layers in
`CompressedTensorsConfig._get_scheme_from_parts`, experts in
`CompressedTensorsMoEMethod.get_moe_method`. The scheme allocates the checkpoint tensors and
chooses the kernels, and through them the activations the engine computes. Line numbers are
vLLM 0.33.0's; the schemes' `create_weights` are the same in the vLLM 0.32 CPU build that
tests/vllm/test_support_matrix.py runs.

Backend policy: DeepGEMM for FP8 block (W8A8, both roles) and MXFP8 experts, where the engine
honours it. MXFP8 and MXFP4 Linear layers have no DeepGEMM kernel, compressed-tensors MXFP4
experts ignore `moe_backend` (W4A4) or would compute FP8 1x128 activations under DeepGEMM (W4A8),
and NVFP4 is served weight-only: all automatic. On Hopper, FP8 block weights with FP32 checkpoint
scales turn DeepGEMM's E8M0 scale packing off (packing rounds every scale to a power of two); on
Blackwell DeepGEMM requantizes them to power-of-two scales at load and the decision says so.
"""

from __future__ import annotations

from adapters.engine_profile import NATIVE_LAYOUTS, SGLANG_MXFP8, StaticEngineProfile
from domain.quant.backend_policy import AUTO, BackendChoice, BackendPolicy, KernelRole, deep_gemm
from domain.quant.dispatch_types import EngineDispatch
from domain.quant.formats import FP8_BLOCK, MXFP4, MXFP8, NVFP4, PrecisionFormat
from domain.quant.formats import ActivationScheme as A
from domain.quant.plan import QuantizationPlan
from domain.quant.support import (
    COMPRESSED_TENSORS,
    CPU_ENGINE,
    CPU_SERVED,
    GPU_SCRIPT,
    MODELOPT_NVFP4,
    NATIVE_FP8,
    READ,
    Cell,
    SupportTable,
    Verdict,
    cite,
)

NAME = PACKAGE = "vllm"
# The release the adapter is written and checked against
# (tests/integration/test_engine_conformance.py reads the pinned wheel).
PINNED_VLLM = "0.33.0"
# The vLLM releases the adapter supports: 0.32 (run for real on the CPU build, tests/vllm) and
# 0.33 (its reload code is byte-identical; checked statically against the wheel).
SUPPORTED_VLLM = ("0.32", "0.33")
VLLM_RANGE = ">=0.32,<0.34"

_Q = "vllm/model_executor/layers/quantization/"
_CTC = _Q + "compressed_tensors/compressed_tensors.py"
_CTM = _Q + "compressed_tensors/compressed_tensors_moe/compressed_tensors_moe.py"
_SCH = _Q + "compressed_tensors/schemes/"
_MOE = _Q + "compressed_tensors/compressed_tensors_moe/"
_ORACLE = "vllm/model_executor/layers/fused_moe/oracle/"
_KERNELS = "vllm/model_executor/kernels/linear/__init__.py"
_MO = _Q + "modelopt.py"


def _v(path: str, lines: str) -> str:
    return cite(PACKAGE, PINNED_VLLM, path, lines)


def _cell(role: str, fmt: str, act: A, layout: str = COMPRESSED_TENSORS) -> Cell:
    return Cell(NAME, layout, role, fmt, act)


_E8M0_NOTE = ("with DeepGEMM and VLLM_USE_DEEP_GEMM_E8M0 on (vLLM's default; the backend policy turns it off on "
              "Hopper), weights and block scales are requantized to power-of-two (UE8M0) scales at load, so the "
              "served bytes are not the exported ones")
_NVFP4_STATIC_INPUT = ("the compressed-tensors NVFP4 W4A4 scheme allocates a static input_global_scale and quantizes "
                       "every activation with it; compressed-tensors has no per-token NVFP4 path. The trainer exports "
                       "no input_global_scale, so the engine would use the dummy load's values, or uninitialised "
                       "memory after a refit")

VLLM_VERDICTS: tuple[Verdict, ...] = (
    # --- dense Linear layers, compressed-tensors ---------------------------------------------------
    Verdict(_cell("linear", "FP8_BLOCK", A.FP8_GROUP_128), True,
            "CompressedTensorsW8A8Fp8: weight e4m3 [N, K], weight_scale f32 [N/128, K/128]; activations FP8 "
            "1x128, dynamic",
            (_v(_CTC, "876-905"), _v(_SCH + "compressed_tensors_w8a8_fp8.py", "64-77"),
             _v(_SCH + "compressed_tensors_w8a8_fp8.py", "114-131"),
             _v("vllm/model_executor/kernels/linear/scaled_mm/deep_gemm.py", "84-100"),
             _v(_Q + "utils/fp8_utils.py", "1195-1214")),
            (READ, CPU_ENGINE, CPU_SERVED), note=_E8M0_NOTE),
    Verdict(_cell("linear", "FP8_BLOCK", A.NONE), True,
            "CompressedTensorsW8A16Fp8: weight e4m3, weight_scale f32 blocks (renamed weight_scale_inv when "
            "processed); Humming or Marlin W8A16 kernels",
            (_v(_CTC, "915-920"), _v(_SCH + "compressed_tensors_w8a16_fp8.py", "88-102"),
             _v(_SCH + "compressed_tensors_w8a16_fp8.py", "120-130"), _v(_KERNELS, "522-526")),
            (READ, CPU_ENGINE), note="DeepGEMM has no W8A16 kernel: vLLM picks Humming or Marlin"),
    Verdict(_cell("linear", "MXFP8", A.MXFP8), True,
            "CompressedTensorsW8A8Mxfp8: weight e4m3 [N, K], weight_scale u8 [N, K/32]; activations MXFP8, dynamic",
            (_v(_CTC, "814-815"), _v(_SCH + "compressed_tensors_w8a8_mxfp8.py", "25-79"), _v(_KERNELS, "568-577")),
            (READ, CPU_ENGINE, GPU_SCRIPT, CPU_SERVED),
            note="MXFP8 activations on FlashInfer's SM100 kernels; on older GPUs Marlin, emulation or torch"),
    Verdict(_cell("linear", "MXFP8", A.NONE), False,
            "CompressedTensorsW8A8Mxfp8, chosen from the weights alone",
            (_v(_CTC, "814-815"), _v(_SCH + "compressed_tensors_w8a8_mxfp8.py", "25-34")), (READ, CPU_ENGINE),
            reason="vLLM has no weight-only MXFP8 Linear: CompressedTensorsW8A8Mxfp8 is chosen from the weights "
                   "alone and quantizes activations to MXFP8 whatever input_activations say",
            instead="use MXFP8 activations (drop rollout.quantization.linear_activation), or FP8_BLOCK with "
                    "linear_activation: none"),
    Verdict(_cell("linear", "MXFP4", A.MXFP4), True,
            "CompressedTensorsW4A4Mxfp4: weight_packed u8 [N, K/2], weight_scale u8 [N, K/32]; kernels for MXFP4 "
            "activations (kMxfp4Dynamic)",
            (_v(_CTC, "811-812"), _v(_SCH + "compressed_tensors_w4a4_mxfp4.py", "39-88"), _v(_KERNELS, "625-632")),
            (READ, CPU_ENGINE, GPU_SCRIPT),
            note="MXFP4 activations need FlashInfer's SM100 kernel; below SM100 Marlin serves the layer weight-only "
                 "(vllm/model_executor/kernels/linear/mxfp4/marlin.py:27-37). linear_backend=deep_gemm has no "
                 "MXFP4 kernel, so it is not requested"),
    Verdict(_cell("linear", "MXFP4", A.MXFP8), False,
            "CompressedTensorsW4A8Mxfp4 with an FP8 (1x32, float32 scales) activation key",
            (_v(_CTC, "459-490"), _v(_SCH + "compressed_tensors_w4a8_mxfp4.py", "15-33")), (READ, CPU_ENGINE),
            reason="vLLM reads MXFP8 input_activations as FP8 per 1x32 group with float32 scales, not MXFP8's E8M0 "
                   "scales, and where no kernel takes that key falls back to MXFP4 activations: it never computes "
                   "the MXFP8 activations the plan declares",
            instead="keep MXFP4 activations for MXFP4 Linear layers (W4A8 is served for experts, "
                    "rollout.quantization.moe_activation: mxfp8)"),
    Verdict(_cell("linear", "MXFP4", A.NONE), False,
            "CompressedTensorsW4A4Mxfp4, chosen from the weights alone",
            (_v(_CTC, "811-812"), _v(_SCH + "compressed_tensors_w4a4_mxfp4.py", "39-44")), (READ, CPU_ENGINE),
            reason="vLLM has no weight-only compressed-tensors MXFP4 Linear: CompressedTensorsW4A4Mxfp4 is chosen "
                   "from the weights alone and asks for MXFP4 activation kernels",
            instead="use MXFP4 activations (drop rollout.quantization.linear_activation), or NVFP4 with "
                    "linear_activation: none"),
    Verdict(_cell("linear", "NVFP4", A.NVFP4_PER_TOKEN), False,
            "CompressedTensorsW4A4Fp4 with a static input_global_scale",
            (_v(_SCH + "compressed_tensors_w4a4_nvfp4.py", "86-91"), _v(_CTC, "795-804"),
             _v(_SCH + "compressed_tensors_w4a4_nvfp4.py", "114-135"),
             _v("vllm/model_executor/model_loader/reload/meta.py", "49-61")),
            (READ, CPU_ENGINE), reason=_NVFP4_STATIC_INPUT,
            instead="serve NVFP4 weight-only (rollout.quantization.linear_activation: none), or MXFP4 / MXFP8"),
    Verdict(_cell("linear", "NVFP4", A.NONE), True,
            "CompressedTensorsW4A4Fp4(use_a16=True): weight_packed u8 [N, K/2], weight_global_scale f32 [shards], "
            "weight_scale e4m3 [N, K/16], no input_global_scale; W4A16 kernels",
            (_v(_CTC, "796-797"), _v(_SCH + "compressed_tensors_w4a4_nvfp4.py", "53-91"), _v(_KERNELS, "1237-1248")),
            (READ, CPU_ENGINE, GPU_SCRIPT),
            note="FlashInfer CuTe-DSL W4A16 on SM100/SM103, Marlin or Humming elsewhere"),
    # --- routed experts, compressed-tensors --------------------------------------------------------
    Verdict(_cell("moe", "FP8_BLOCK", A.FP8_GROUP_128), True,
            "CompressedTensorsW8A8Fp8MoEMethod: w13_weight/w2_weight e4m3, w13_weight_scale/w2_weight_scale f32 "
            "blocks; moe_backend honoured",
            (_v(_CTM, "161-172"), _v(_MOE + "compressed_tensors_moe_w8a8_fp8.py", "152-164"),
             _v(_MOE + "compressed_tensors_moe_w8a8_fp8.py", "211-233"), _v(_ORACLE + "fp8.py", "271-289"),
             _v(_Q + "utils/fp8_utils.py", "1256-1274")),
            (READ, CPU_SERVED), note=_E8M0_NOTE),
    Verdict(_cell("moe", "FP8_BLOCK", A.NONE), False,
            "no weight-only FP8 expert scheme",
            (_v(_CTC, "532-535"), _v(_CTM, "161-173")), (READ, CPU_ENGINE),
            reason="vLLM has no weight-only FP8 expert scheme for compressed-tensors: get_moe_method falls through "
                   "to _is_dynamic_token_w8a8, which reads num_bits of the missing input_activations and raises "
                   "AttributeError at start-up",
            instead="use FP8 activations for FP8_BLOCK experts (drop rollout.quantization.moe_activation)"),
    Verdict(_cell("moe", "MXFP8", A.MXFP8), True,
            "CompressedTensorsW8A8Mxfp8MoEMethod: w13_weight/w2_weight e4m3, w13_weight_scale/w2_weight_scale u8 "
            "[E, N, K/32]; kernels for MXFP8 activations",
            (_v(_CTM, "83-88"), _v(_MOE + "compressed_tensors_moe_w8a8_mxfp8.py", "35-113"),
             _v(_ORACLE + "mxfp8.py", "20-59"), _v(_ORACLE + "mxfp8.py", "81-130")),
            (READ, CPU_ENGINE, GPU_SCRIPT, CPU_SERVED),
            note="moe_backend=deep_gemm gives DeepGemmExperts (MXFP8 1x32, SM100); auto picks TRT-LLM, DeepGEMM, "
                 "then Marlin (weight-only) on older GPUs"),
    Verdict(_cell("moe", "MXFP8", A.NONE), False,
            "CompressedTensorsW8A8Mxfp8MoEMethod, chosen from the weights alone",
            (_v(_CTM, "83-88"), _v(_ORACLE + "mxfp8.py", "81-105")), (READ, CPU_ENGINE),
            reason="vLLM has no weight-only MXFP8 experts: CompressedTensorsW8A8Mxfp8MoEMethod is chosen from the "
                   "weights alone and selects kernels for MXFP8 activations",
            instead="use MXFP8 activations (drop rollout.quantization.moe_activation)"),
    Verdict(_cell("moe", "MXFP4", A.MXFP4), True,
            "CompressedTensorsW4A4Mxfp4MoEMethod: w13_weight_packed/w2_weight_packed u8, "
            "w13_weight_scale/w2_weight_scale u8; CUTLASS MXFP4 x MXFP4 experts where the GPU has them",
            (_v(_CTM, "76-81"), _v(_MOE + "compressed_tensors_moe_w4a4_mxfp4.py", "52-150"),
             _v("vllm/model_executor/layers/fused_moe/experts/cutlass_moe.py", "1036-1041"),
             _v(_MOE + "compressed_tensors_moe_w4a4_mxfp4.py", "226-232")),
            (READ, CPU_ENGINE, GPU_SCRIPT),
            note="moe_backend is read only for b12x and FlashInfer MoE-EP, so deep_gemm is not requested; without "
                 "CUTLASS MXFP4 (SM100) vLLM serves the experts weight-only with Marlin"),
    Verdict(_cell("moe", "MXFP4", A.MXFP8), True,
            "CompressedTensorsW4A8Mxfp4MoEMethod (vLLM's MXFP4 experts, tensors named *_packed); auto backend "
            "order TRT-LLM MXFP4 x MXFP8 (kMxfp8Dynamic), DeepGEMM (FP8 1x128), Marlin, Humming",
            (_v(_CTM, "66-74"), _v(_MOE + "compressed_tensors_moe_w4a8_mxfp4.py", "10-34"),
             _v(_Q + "mxfp4.py", "578-580"), _v(_ORACLE + "mxfp4.py", "438-476"), _v(_ORACLE + "mxfp4.py", "763-808")),
            (READ, GPU_SCRIPT),
            note="the declared MXFP8 activations only with the TRT-LLM kernel (SM100); moe_backend=deep_gemm would "
                 "compute FP8 1x128 activations and is not requested"),
    Verdict(_cell("moe", "MXFP4", A.NONE), False,
            "CompressedTensorsW4A4Mxfp4MoEMethod, chosen from the weights alone",
            (_v(_CTM, "76-81"), _v(_MOE + "compressed_tensors_moe_w4a4_mxfp4.py", "63-71")), (READ, CPU_ENGINE),
            reason="vLLM has no weight-only compressed-tensors MXFP4 experts: CompressedTensorsW4A4Mxfp4MoEMethod "
                   "is chosen from the weights alone and runs MXFP4 x MXFP4 where the GPU can",
            instead="use MXFP4 or MXFP8 activations (rollout.quantization.moe_activation), or NVFP4 experts with "
                    "moe_activation: none"),
    Verdict(_cell("moe", "NVFP4", A.NVFP4_PER_TOKEN), False,
            "CompressedTensorsW4A4Nvfp4MoEMethod with static input global scales",
            (_v(_MOE + "compressed_tensors_moe_w4a4_nvfp4.py", "170-189"),
             _v(_MOE + "compressed_tensors_moe_w4a4_nvfp4.py", "63-67"),
             _v(_MOE + "compressed_tensors_moe_w4a4_nvfp4.py", "243-256")),
            (READ, CPU_ENGINE), reason="the compressed-tensors NVFP4 expert method allocates w13_input_global_scale and "
                   "w2_input_global_scale and selects kernels for a static activation global scale; the trainer "
                   "exports neither scale, so the engine would use the dummy load's values, or uninitialised memory "
                   "after a refit",
            instead="keep rollout.quantization.linear null: vLLM serves per-token NVFP4 experts from ModelOpt's "
                    "NVFP4 layout (the modelopt-nvfp4 cell), which the export uses when the experts are the only "
                    "quantized role; or serve NVFP4 experts weight-only (rollout.quantization.moe_activation: none)"),
    Verdict(_cell("moe", "NVFP4", A.NONE), True,
            "CompressedTensorsW4A4Nvfp4MoEMethod(use_a16=True): w13/w2_weight_packed u8, w13/w2_weight_scale e4m3, "
            "w13_weight_global_scale f32 [E, 2], w2_weight_global_scale f32 [E]; weight-only kernels",
            (_v(_CTM, "145-160"), _v(_MOE + "compressed_tensors_moe_w4a4_nvfp4.py", "89-168"),
             _v(_ORACLE + "nvfp4.py", "191-322"), _v(_ORACLE + "nvfp4.py", "450-463"),
             _v("vllm/model_executor/layers/fused_moe/experts/trtllm_nvfp4_moe.py", "219-227")),
            (READ, CPU_ENGINE, GPU_SCRIPT, CPU_SERVED),
            note="auto selection with no activation key picks Marlin or Humming, which ignore the "
                 "w13/w2_input_global_scale the method still allocates (moe_w4a4_nvfp4.py:170-189); "
                 "moe_backend=flashinfer_trtllm would fail at start-up, so it is not requested. Those unexported "
                 "scales keep the experts' processing until finalize_refit "
                 "(vllm/model_executor/model_loader/reload/layerwise.py:269-275)"),
    # --- ModelOpt's NVFP4 layout (domain.quant.modelopt_layout) -------------------------------------
    Verdict(_cell("moe", "NVFP4", A.NVFP4_PER_TOKEN, MODELOPT_NVFP4), True,
            "ModelOptNvFp4FusedMoE with the expert activation override nvfp4_per_token (engine argument "
            "quantization_config={moe: {activation: nvfp4_per_token}}): w13_weight/w2_weight u8, "
            "w13_weight_scale/w2_weight_scale e4m3, w13_weight_scale_2 f32 [E, 2] (gate and up share one), "
            "w2_weight_scale_2 f32 [E]; input scales filled with 1.0; activations NVFP4 per token "
            "(quantize_nvfp4_per_token_input, base scale 1 / (448 * 6)) on the FlashInfer TRT-LLM backend",
            (_v(_MO, "860-886"), _v(_MO, "748-751"), _v(_MO, "912-1038"), _v(_MO, "1051-1053"),
             _v(_Q + "utils/flashinfer_utils.py", "55-66"), _v(_ORACLE + "nvfp4.py", "203-213"),
             _v("vllm/model_executor/layers/fused_moe/experts/trtllm_nvfp4_moe.py", "219-228"),
             _v("vllm/config/quantization.py", "45-45")),
            (READ, CPU_SERVED),
            note="GPU backend: FlashInfer TRT-LLM NVFP4 experts on SM100 (Blackwell), the only backend the method "
                 "accepts for per-token activations; on vLLM's CPU build rl-refit's emulation plugin answers it "
                 "with plain-torch experts (adapters.vllm.moe_emulation)"),
    Verdict(_cell("linear", "NVFP4", A.NVFP4_PER_TOKEN, MODELOPT_NVFP4), False,
            "ModelOpt NVFP4 Linear (quant_algo NVFP4): W4A4 with a static input scale",
            (_v(_MO, "2752-2755"), _v(_MO, "748-751")), (READ,),
            reason="vLLM's ModelOpt NVFP4 Linear quantizes activations with the checkpoint's static input scale; "
                   "the nvfp4_per_token override applies to the experts only",
            instead="keep rollout.quantization.linear null with per-token NVFP4 experts, or serve NVFP4 Linear "
                    "layers weight-only (rollout.quantization.linear_activation: none)"),
    # --- native layouts ------------------------------------------------------------------------------
    Verdict(_cell("linear", "FP8_BLOCK", A.FP8_GROUP_128, NATIVE_FP8), True,
            "Fp8LinearMethod (quant_method: fp8, block [128, 128]): weight e4m3, weight_scale_inv f32 blocks",
            (_v(_Q + "fp8.py", "225-339"),), note=_E8M0_NOTE),
    Verdict(_cell("moe", "FP8_BLOCK", A.FP8_GROUP_128, NATIVE_FP8), True,
            "Fp8MoEMethod (quant_method: fp8, block [128, 128]): w13_weight/w2_weight e4m3, "
            "w13_weight_scale_inv/w2_weight_scale_inv f32 blocks",
            (_v(_Q + "fp8.py", "464-488"),), note=_E8M0_NOTE),
    Verdict(_cell("linear", "MXFP8", A.MXFP8, SGLANG_MXFP8), False,
            "ModelOptMxFp8Config (quant_method: mxfp8)",
            (_v(_Q + "__init__.py", "181-184"), _v(_Q + "modelopt.py", "1203-1258")),
            reason="vLLM reads quant_method: mxfp8 with its ModelOpt MXFP8 config, whose block scales are named "
                   "weight_scale, not the weight_scale_inv of SGLang's native MXFP8 layout",
            instead="serve MXFP8 as compressed-tensors: drop the quant_method: mxfp8 config and set "
                    "rollout.quantization.linear / moe: MXFP8"),
    Verdict(_cell("moe", "MXFP8", A.MXFP8, SGLANG_MXFP8), False,
            "ModelOptMxFp8FusedMoE (quant_method: mxfp8)",
            (_v(_Q + "__init__.py", "181-184"), _v(_Q + "modelopt.py", "1370-1375")),
            reason="vLLM reads quant_method: mxfp8 with its ModelOpt MXFP8 config, whose expert scales are "
                   "w13_weight_scale / w2_weight_scale, not the weight_scale_inv of SGLang's native MXFP8 layout",
            instead="serve MXFP8 as compressed-tensors: drop the quant_method: mxfp8 config and set "
                    "rollout.quantization.linear / moe: MXFP8"),
)


# --- backend policy ---------------------------------------------------------------------------------


def _role(role: KernelRole, fmt: PrecisionFormat, act: A, native: bool, cap: tuple[int, int] | None) -> BackendChoice:
    if fmt.name == FP8_BLOCK.name:
        if act is A.NONE:
            return BackendChoice(role, AUTO, "FP8_BLOCK weight-only (W8A16): DeepGEMM has no W8A16 kernel; vLLM "
                                             "picks Humming or Marlin")
        return deep_gemm(role, "FP8_BLOCK: DeepGEMM, the kernels training's numerics match", cap)
    if fmt.name == MXFP8.name:
        if role == "moe":
            return deep_gemm(role, "MXFP8 experts: DeepGEMM (MXFP8 1x32 activations)", cap)
        return BackendChoice(role, AUTO, "MXFP8 Linear has no DeepGEMM kernel: automatic choice")
    if fmt.name == MXFP4.name:
        if role == "linear":
            return BackendChoice(role, AUTO, "MXFP4 Linear has no DeepGEMM kernel: automatic choice (FlashInfer "
                                             "MXFP4 on SM100)")
        if act is A.MXFP8:
            return BackendChoice(role, AUTO, "W4A8 experts: automatic choice puts TRT-LLM MXFP4 x MXFP8 first; "
                                             "DeepGEMM would compute FP8 1x128 activations instead of MXFP8")
        return BackendChoice(role, AUTO, "MXFP4 experts: vLLM ignores moe_backend=deep_gemm here and runs CUTLASS "
                                         "MXFP4 x MXFP4 where the GPU has it")
    if role == "moe" and act is A.NVFP4_PER_TOKEN:
        return BackendChoice(role, AUTO, "NVFP4 experts, per-token activations (ModelOpt layout): FlashInfer "
                                         "TRT-LLM on SM100, the only backend vLLM accepts for them (automatic "
                                         "selection puts it first)")
    return BackendChoice(role, AUTO, f"{fmt.name} weight-only: vLLM's W4A16 kernels (FlashInfer TRT-LLM has none)")


BACKEND_POLICY = BackendPolicy(
    NAME, _role, hopper_e8m0_off=True, ue8m0_where=_v(_Q + "utils/fp8_utils.py", "1213-1214"))

def default_layout(plan: QuantizationPlan) -> str:
    """The layout a plan from rollout.quantization reaches vLLM in: NVFP4 experts with per-token
    activations, the only quantized role, in ModelOpt's NVFP4 layout (vLLM serves per-token NVFP4
    experts from it alone); everything else as compressed-tensors."""
    if (plan.moe.name == NVFP4.name and plan.effective_moe_activation is A.NVFP4_PER_TOKEN
            and not plan.linear.is_quantized and not plan.targets):
        return MODELOPT_NVFP4
    return COMPRESSED_TENSORS


VLLM = StaticEngineProfile(
    NAME,
    EngineDispatch(NAME, NATIVE_LAYOUTS, default_layout, SupportTable(NAME, PINNED_VLLM, VLLM_VERDICTS)),
    package=PACKAGE,
    pinned_version=PINNED_VLLM,
    backend_policy=BACKEND_POLICY,
    table_layouts={MXFP8.name: (SGLANG_MXFP8,), FP8_BLOCK.name: (NATIVE_FP8,), NVFP4.name: (MODELOPT_NVFP4,)},
)
