"""A plain-torch FP8 block-scaled linear kernel for vLLM's CPU platform, where vLLM's own two (AMX
BRGEMM, W8A16 and W8A8) need AMX tiles.

Written to vLLM's `Fp8BlockScaledMMLinearKernel` interface, so everything around the matmul stays
vLLM's code: weight creation, loading, `process_weights_after_loading` (the base class's
`process_fp8_weight_block_strategy`, which keeps the checkpoint's [N, K] layout on CPU) and the
layerwise reload. Only `apply_block_scaled_mm` is ours.

W8A8: activations are quantized by the base class with vLLM's own `QuantFP8` (dynamic, one scale
per 1x128 group of each token, the torch path of `per_token_group_quant_fp8`), exactly as vLLM's
GPU block kernels receive them. The product is computed on the dequantized operands in FP32:

    out = (A_e4m3 * As) @ (B_e4m3 * Bs)^T

with As broadcast over each 1 x block_k group and Bs over each block_n x block_k block. That is the
value the GPU kernels compute, up to FP32 summation order.

Imported only on a vLLM engine's CPU platform (adapters.vllm.cpu_emulation registers it).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
    Fp8BlockScaledMMLinearKernel,
)
from vllm.platforms import current_platform

from adapters.vllm.moe_emulation import expand_block_scale


class TorchFp8BlockScaledMMKernel(Fp8BlockScaledMMLinearKernel):
    """FP8 W8A8 block-scaled GEMM in plain torch (FP32 accumulation), for vLLM's CPU platform."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        if not current_platform.is_cpu():
            return False, "rl-refit's emulated FP8 block kernel runs on the CPU platform only."
        return True, None

    @classmethod
    def can_implement(cls, config: Any) -> tuple[bool, str | None]:
        ok, reason = super().can_implement(config)
        if not ok:
            return ok, reason
        act = config.activation_quant_key.scale.group_shape
        weight = config.weight_quant_key.scale.group_shape
        if act.row != 1 or act.col != weight.col:
            return False, f"needs 1x{weight.col} activation groups for {weight.row}x{weight.col} weight blocks, got {act.row}x{act.col}."
        return True, None

    def apply_block_scaled_mm(self, A: torch.Tensor, B: torch.Tensor, As: torch.Tensor, Bs: torch.Tensor) -> torch.Tensor:
        m, k = A.shape
        n = B.shape[0]
        block_n, block_k = self.weight_group_shape.row, self.weight_group_shape.col
        a = A.to(torch.float32) * expand_block_scale(As.to(torch.float32), m, k, 1, block_k)
        b = B.to(torch.float32) * expand_block_scale(Bs.to(torch.float32), n, k, block_n, block_k)
        return a @ b.t()
