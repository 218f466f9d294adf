"""Plain-torch quantized MoE experts for vLLM's CPU platform, written to vLLM's modular
`FusedMoEExpertsModular` interface (adapters.vllm.moe_emulation selects them).

vLLM builds the kernel around them as for any backend: its prepare/finalize (no DP/EP), its
quant config (`make_fp8_moe_quant_config`, `make_nvfp4_moe_quant_config`) holding references to
the layer's scale parameters, and the weights its MoE method post-processed. What is ours is
`apply`: for each routed expert, dequantize its weights by their scales, then the two GEMMs in
FP32 (adapters.vllm.moe_emulation.experts_forward), vLLM's activation (`apply_moe_activation`,
silu-and-mul for Qwen3 MoE) on the first GEMM's output in the activation dtype, as vLLM's Triton
path stores it, router weights applied once in FP32, one cast to the output dtype. Nothing is
cached between calls: a refit's new weights are read on the next step.

Activations, per format, as vLLM's GPU kernels for it receive them:

| class | weights | activations (both GEMMs' inputs) |
|---|---|---|
| TorchFp8BlockExperts | e4m3, FP32 block scales | W8A8: vLLM's `QuantFP8`, dynamic 1 x block_k groups (its torch path; the dense FP8 block kernel's) |
| TorchMxfp8Experts | e4m3, E8M0 1x32 scales (`dequant_mxfp8_to_bf16`, exact) | W8A8: vLLM's `mxfp8_e4m3_quantize` (its torch path on CPU), as the native MXFP8 MoE kernels; vLLM's own Mxfp8EmulationTritonExperts keeps BF16 |
| TorchNvfp4Experts | packed e2m1, e4m3 1x16 scales x 1/global scale (`dequantize_to_dtype`) | BF16 (weight-only NVFP4) |
| TorchNvfp4PerTokenExperts | the same, the decode scale being ModelOpt's `weight_scale_2` | NVFP4 per token, as FlashInfer's TRT-LLM experts quantize both GEMM inputs (`domain.quant.codecs.activations.nvfp4_per_token`, decoded e2m1 x block scale x per-token scale) |

Imported only on a vLLM engine's CPU platform.
"""

from __future__ import annotations

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
from vllm.model_executor.layers.quantization.utils.mxfp8_utils import (
    MXFP8_BLOCK_SIZE,
    dequant_mxfp8_to_bf16,
    mxfp8_e4m3_quantize,
)
from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    GroupShape,
    QuantKey,
    kFp8Dynamic128Sym,
    kFp8Static128BlockSym,
    kMxfp8Dynamic,
    kMxfp8Static,
    kNvfp4DynamicToken,
    kNvfp4Static,
)
from vllm.platforms import current_platform

from adapters.vllm.moe_emulation import dequantize_fp8_block, dequantize_groups, experts_forward
from domain.quant.codecs.activations import nvfp4_per_token, nvfp4_per_token_dequantize

NVFP4_GROUP_SIZE = 16


class _TorchExperts(mk.FusedMoEExpertsModular):
    """What the three classes share: everything but the weights' dequantization and the
    activations' quantization."""

    SCHEME: tuple[QuantKey | None, QuantKey | None] = (None, None)

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def is_supported_config(cls: type[mk.FusedMoEExperts], moe_config: FusedMoEConfig, weight_key: QuantKey | None,
                            activation_key: QuantKey | None,
                            activation_format: mk.FusedMoEActivationFormat) -> tuple[bool, str | None]:
        if moe_config.has_bias:
            return False, "kernel does not support expert bias"
        if moe_config.swiglu_limit is not None:
            return False, "kernel does not support a SwiGLU clamp"
        return mk.FusedMoEExperts.is_supported_config(cls, moe_config, weight_key, activation_key, activation_format)

    @staticmethod
    def _supports_current_device() -> bool:
        return current_platform.is_cpu()

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        # The gated activations whose vLLM op the CPU build has (apply_moe_activation's torch.ops._C).
        return activation in (MoEActivation.SILU, MoEActivation.GELU, MoEActivation.GELU_TANH)

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: FusedMoEParallelConfig) -> bool:
        return not moe_parallel_config.use_all2all_kernels

    @classmethod
    def _supports_quant_scheme(cls, weight_key: QuantKey | None, activation_key: QuantKey | None) -> bool:
        return (weight_key, activation_key) == cls.SCHEME

    @property
    def expects_unquantized_inputs(self) -> bool:
        # Activations are quantized in `apply`, with vLLM's torch quantizers: the prepare step's
        # FP8 group quantization is a Triton kernel off CUDA.
        return True

    def workspace_shapes(self, M: int, N: int, K: int, topk: int, global_num_experts: int, local_num_experts: int,
                         expert_tokens_meta: mk.ExpertTokensMetadata | None,
                         activation: MoEActivation) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        return (0,), (0,), (M, K)

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()

    def _weights(self, w: torch.Tensor, which: int, e: int) -> torch.Tensor:
        """Expert `e`'s weight of GEMM `which` (1 or 2), dequantized, FP32."""
        raise NotImplementedError

    def _activations(self, x: torch.Tensor) -> torch.Tensor:
        """A GEMM's input as the format's kernels see it, FP32 (default: unquantized)."""
        return x.to(torch.float32)

    def apply(self, output: torch.Tensor, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: MoEActivation, global_num_experts: int,
              expert_map: torch.Tensor | None, a1q_scale: torch.Tensor | None, a2_scale: torch.Tensor | None,
              workspace13: torch.Tensor, workspace2: torch.Tensor, expert_tokens_meta: mk.ExpertTokensMetadata | None,
              apply_router_weight_on_input: bool) -> None:
        dtype = hidden_states.dtype
        local_ids = topk_ids.long() if expert_map is None else expert_map[topk_ids.long()].long()

        def hidden(h: torch.Tensor) -> torch.Tensor:
            h = h.to(dtype)  # the first GEMM's output in the activation dtype, as vLLM's Triton path keeps it
            act = h.new_empty((h.shape[0], self.adjust_N_for_activation(h.shape[1], activation)))
            self.activation(activation, act, h)
            return self._activations(act)

        out = experts_forward(
            self._activations(hidden_states), topk_weights, local_ids,
            lambda e: (self._weights(w1, 1, e), self._weights(w2, 2, e)), hidden,
            apply_router_weight_on_input=apply_router_weight_on_input)
        output.copy_(out.to(output.dtype))


class TorchFp8BlockExperts(_TorchExperts):
    """FP8 block-scaled W8A8 experts (compressed-tensors FP8_BLOCK) in plain torch."""

    SCHEME = (kFp8Static128BlockSym, kFp8Dynamic128Sym)

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig) -> None:
        super().__init__(moe_config, quant_config)
        if self.block_shape is None:
            raise ValueError("TorchFp8BlockExperts needs the weights' block shape in the MoE quant config")
        self._block = (int(self.block_shape[0]), int(self.block_shape[1]))
        self._quant = QuantFP8(static=False, group_shape=GroupShape(1, self._block[1]), use_ue8m0=False)

    def _weights(self, w: torch.Tensor, which: int, e: int) -> torch.Tensor:
        scale = self.w1_scale if which == 1 else self.w2_scale
        assert scale is not None
        return dequantize_fp8_block(w[e], scale[e], self._block)

    def _activations(self, x: torch.Tensor) -> torch.Tensor:
        qdata, scale = self._quant(x.contiguous())
        return dequantize_groups(qdata, scale, self._block[1])


class TorchMxfp8Experts(_TorchExperts):
    """MXFP8 W8A8 experts (compressed-tensors MXFP8) in plain torch."""

    SCHEME = (kMxfp8Static, kMxfp8Dynamic)

    def _weights(self, w: torch.Tensor, which: int, e: int) -> torch.Tensor:
        scale = self.w1_scale if which == 1 else self.w2_scale
        assert scale is not None
        return dequant_mxfp8_to_bf16(w[e], scale[e]).to(torch.float32)

    def _activations(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % MXFP8_BLOCK_SIZE:
            raise ValueError(f"MXFP8 activations need a multiple of {MXFP8_BLOCK_SIZE} features, got {x.shape[-1]}")
        qdata, scale = mxfp8_e4m3_quantize(x.contiguous(), False)
        return dequant_mxfp8_to_bf16(qdata, scale).to(torch.float32)


class TorchNvfp4Experts(_TorchExperts):
    """Weight-only NVFP4 experts (compressed-tensors NVFP4, no input activations) in plain torch."""

    SCHEME = (kNvfp4Static, None)

    def _weights(self, w: torch.Tensor, which: int, e: int) -> torch.Tensor:
        scale, alpha = (self.w1_scale, self.g1_alphas) if which == 1 else (self.w2_scale, self.g2_alphas)
        assert scale is not None and alpha is not None
        # alpha is vLLM's 1 / weight_global_scale (convert_to_nvfp4_moe_kernel_format's w*_scale_2).
        return dequantize_to_dtype(w[e], scale[e], alpha[e], torch.float32, NVFP4_GROUP_SIZE, swizzle=False)


class TorchNvfp4PerTokenExperts(TorchNvfp4Experts):
    """NVFP4 experts with per-token NVFP4 activations (ModelOpt NVFP4 checkpoints, expert activation
    override `nvfp4_per_token`) in plain torch: what vLLM's FlashInfer TRT-LLM experts compute on
    SM100, where both GEMM inputs are quantized per token with the base scale 1 / (448 * 6)
    (`quantize_nvfp4_per_token_input` before GEMM1; the same kernel on GEMM1's BF16 output)."""

    SCHEME = (kNvfp4Static, kNvfp4DynamicToken)

    def __init__(self, moe_config: FusedMoEConfig, quant_config: FusedMoEQuantConfig,
                 per_token_activation: bool = True) -> None:
        # make_nvfp4_moe_kernel passes per_token_activation=True for the FLASHINFER_TRTLLM backend.
        if not per_token_activation:
            raise ValueError("TorchNvfp4PerTokenExperts computes per-token NVFP4 activations only")
        super().__init__(moe_config, quant_config)

    def _activations(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % NVFP4_GROUP_SIZE:
            raise ValueError(f"NVFP4 activations need a multiple of {NVFP4_GROUP_SIZE} features, got {x.shape[-1]}")
        return nvfp4_per_token_dequantize(*nvfp4_per_token(x.reshape(-1, x.shape[-1])))
