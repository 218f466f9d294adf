"""Precision formats: the presets a rollout can be served in, as frozen value objects.

Element types follow the OCP MX / NVIDIA definitions (docs/formats.md#element-types).
"""

from __future__ import annotations

import enum

import attrs

F8E4M3_MAX = 448.0
F4E2M1_MAX = 6.0
E8M0_EXPONENT_BIAS = 127
# E2M1 magnitudes, indexed by the 3-bit code (sign is bit 3 of the nibble).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class ElementType(enum.Enum):
    BF16 = "bf16"
    E4M3 = "e4m3"
    E2M1 = "e2m1"

    @property
    def max(self) -> float:
        """Largest finite magnitude (saturation bound)."""
        return {ElementType.E4M3: F8E4M3_MAX, ElementType.E2M1: F4E2M1_MAX}.get(self, float("inf"))

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two not above `max` (8 for E4M3, 2 for E2M1)."""
        return {ElementType.E4M3: 8, ElementType.E2M1: 2}[self]

    @property
    def bits(self) -> int:
        return {ElementType.BF16: 16, ElementType.E4M3: 8, ElementType.E2M1: 4}[self]


class ScaleEncoding(enum.Enum):
    NONE = "none"
    FP32 = "fp32"  # one float32 per block
    E8M0 = "e8m0"  # biased power-of-two exponent in uint8
    E4M3_GLOBAL_FP32 = "e4m3*fp32"  # e4m3 per block, times one float32 global scale


class MxScaleRule(enum.Enum):
    """How an MX block's shared exponent is chosen (docs/formats.md#element-rules)."""

    RCEIL = "rceil"  # exact ceil(log2(amax / elem_max)): Transformer Engine, ModelOpt, vLLM's MXFP8, torchao RCEIL
    EVEN = "even"  # OCP round-to-nearest: compressed-tensors, vLLM's online MXFP4 (Triton downcast_to_mxfp)


class ElementRule(enum.Enum):
    """The operation order that turns a block's values into its scale and elements.

    The two orders differ only on ties and on degenerate (zero or tiny) blocks, on a small share of
    elements, which is enough to break bit-identity (docs/formats.md#element-rules).
    """

    ENGINE = "engine"  # the rollout engine's own online quantizer and the QAT kernels (default)
    COMPRESSED_TENSORS = "compressed-tensors"  # llm-compressor checkpoints, byte for byte


@attrs.frozen
class RuleSpec:
    """One element rule of one format, as `refit plan` and docs/formats.md state it.

    Attributes:
        rule: the element rule.
        formula: the scale and element expressions, in the reference's own operation order.
        reference: the function whose expressions the codec ports.
    """

    rule: ElementRule
    formula: str
    reference: str


class ActivationScheme(enum.Enum):
    """How the rollout quantizes activations (dynamically, per token or per block)."""

    NONE = "none"
    FP8_GROUP_128 = "fp8_per_token_group_128"
    MXFP8 = "mxfp8"
    MXFP4 = "mxfp4"
    NVFP4_PER_TOKEN = "nvfp4_per_token"
    NVFP4_STATIC = "nvfp4_static"  # per-tensor, calibrated: needs input_global_scale


@attrs.frozen
class PrecisionFormat:
    """One rollout weight format: its elements, blocks, scales and checkpoint tensors.

    Attributes:
        name: preset name (FP8_BLOCK, MXFP8, MXFP4, NVFP4, BF16).
        element: element type of the quantized weight.
        block_size: (rows, cols) covered by one scale; (1, 32) means 32 along K.
        scale_encoding: how the block scale is stored.
        activation: the default dynamic activation scheme of the rollout.
        tensor_names: checkpoint tensors one quantized Linear weight becomes.
        ct_format: compressed-tensors CompressionFormat value (None for BF16).
        engine_scale_rule: MX only: the exponent rule of the engine's own quantizer.
        rules: the element rules, with their formulas and references.
    """

    name: str
    element: ElementType
    block_size: tuple[int, int]
    scale_encoding: ScaleEncoding
    activation: ActivationScheme
    tensor_names: tuple[str, ...]
    ct_format: str | None
    engine_scale_rule: MxScaleRule | None = None
    rules: tuple[RuleSpec, ...] = ()

    @property
    def is_quantized(self) -> bool:
        return self.element is not ElementType.BF16

    @property
    def packed(self) -> bool:
        """Two elements per byte (FP4)."""
        return self.element is ElementType.E2M1

    @property
    def weight_name(self) -> str:
        return self.tensor_names[0]

    @property
    def has_global_scale(self) -> bool:
        """One float32 global scale per tensor (NVFP4), shared by the members of a fused group."""
        return self.scale_encoding is ScaleEncoding.E4M3_GLOBAL_FP32

    @property
    def k_multiple(self) -> int:
        """K must be a multiple of this (blocked formats along K); 1 when edge blocks are allowed."""
        rows, cols = self.block_size
        return cols if rows == 1 else 1

    @property
    def is_mx(self) -> bool:
        """One E8M0 exponent per block (MXFP8, MXFP4): the MX scale rule applies."""
        return self.scale_encoding is ScaleEncoding.E8M0

    def scale_rule(self, numerics: ElementRule, override: MxScaleRule | None = None) -> MxScaleRule | None:
        """The MX exponent rule this format uses under `numerics`; None for non-MX formats.

        Args:
            numerics: the element rule.
            override: rollout.quantization.scale_rule when the user set it (it wins).

        Returns:
            The override; else the engine's rule under ENGINE and EVEN under COMPRESSED_TENSORS.
        """
        if not self.is_mx:
            return None
        if override is not None:
            return override
        return self.engine_scale_rule if numerics is ElementRule.ENGINE else MxScaleRule.EVEN

    def rule_spec(self, numerics: ElementRule) -> RuleSpec | None:
        """The formula and reference of `numerics` for this format (None for BF16)."""
        return next((r for r in self.rules if r.rule is numerics), None)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of `weight_scale` for a weight of `shape` (2-D [N, K] or 3-D [E, N, K])."""
        rows, cols = self.block_size
        *lead, n, k = shape
        return (*lead, -(-n // rows), -(-k // cols))


BF16 = PrecisionFormat(
    name="BF16",
    element=ElementType.BF16,
    block_size=(1, 1),
    scale_encoding=ScaleEncoding.NONE,
    activation=ActivationScheme.NONE,
    tensor_names=("weight",),
    ct_format=None,
)
FP8_BLOCK = PrecisionFormat(
    name="FP8_BLOCK",
    element=ElementType.E4M3,
    block_size=(128, 128),
    scale_encoding=ScaleEncoding.FP32,
    activation=ActivationScheme.FP8_GROUP_128,
    tensor_names=("weight", "weight_scale"),
    ct_format="float-quantized",
    rules=(
        RuleSpec(ElementRule.ENGINE,
                 "scale = max(amax, 1e-4) / 448; q = e4m3(x * (1.0 / scale)). Activations (1x128): "
                 "scale = max(amax, 1e-10) / 448; q = e4m3(x / scale)",
                 "vLLM per_block_cast_to_fp8 (DeepGEMM's); activations: vLLM per_token_group_quant_fp8"),
        RuleSpec(ElementRule.COMPRESSED_TENSORS,
                 "scale = amax / 448 (float32 eps for a zero block); q = e4m3(x / scale)",
                 "compressed-tensors calculate_qparams + FloatQuantizationCompressor"),
    ),
)
MXFP8 = PrecisionFormat(
    name="MXFP8",
    element=ElementType.E4M3,
    block_size=(1, 32),
    scale_encoding=ScaleEncoding.E8M0,
    activation=ActivationScheme.MXFP8,
    tensor_names=("weight", "weight_scale"),
    ct_format="mxfp8-quantized",
    engine_scale_rule=MxScaleRule.RCEIL,
    rules=(
        RuleSpec(ElementRule.ENGINE, "e = ceil(log2(amax / 448)) + 127 in [0, 254] (rceil); q = e4m3(x / 2^(e - 127))",
                 "vLLM _mxfp8_e4m3_quantize_torch (online MXFP8, weights and activations)"),
        RuleSpec(ElementRule.COMPRESSED_TENSORS,
                 "e = 127 + floor(log2(round_up_pow2(amax))) - 8 in [0, 254] (even); q = e4m3(x / 2^(e - 127))",
                 "compressed-tensors calculate_qparams + MXFP8QuantizationCompressor"),
    ),
)
MXFP4 = PrecisionFormat(
    name="MXFP4",
    element=ElementType.E2M1,
    block_size=(1, 32),
    scale_encoding=ScaleEncoding.E8M0,
    activation=ActivationScheme.MXFP4,
    tensor_names=("weight_packed", "weight_scale"),
    ct_format="mxfp4-pack-quantized",
    engine_scale_rule=MxScaleRule.EVEN,
    rules=(
        RuleSpec(ElementRule.ENGINE,
                 "e = floor(log2(round_up_pow2(amax))) - 2 + 127 in [0, 254] (even); q = e2m1(x * 2^(127 - e)), "
                 "the sign of -0 kept",
                 "vLLM mxfp4_quantize (Triton downcast_to_mxfp)"),
        RuleSpec(ElementRule.COMPRESSED_TENSORS,
                 "e as for engine (even); q = e2m1(x / 2^(e - 127)), -0 stored as +0",
                 "compressed-tensors calculate_qparams + MXFP4PackedCompressor"),
    ),
)
NVFP4 = PrecisionFormat(
    name="NVFP4",
    element=ElementType.E2M1,
    block_size=(1, 16),
    scale_encoding=ScaleEncoding.E4M3_GLOBAL_FP32,
    activation=ActivationScheme.NVFP4_PER_TOKEN,
    tensor_names=("weight_packed", "weight_scale", "weight_global_scale"),
    ct_format="nvfp4-pack-quantized",
    rules=(
        RuleSpec(ElementRule.ENGINE,
                 "gs = (6 * 448) / max(amax_tensor, 1e-8); s = e4m3(gs * (amax_block * (1 / 6))), 0 kept; "
                 "q = e2m1(x * r(s * r(gs))) with r(t) = 1 / (t + (t == 0) * 1e8), the sign of -0 kept",
                 "vLLM scaled_fp4_quant as its torch mirror ref_nvfp4_quant computes it; global scale as "
                 "Nvfp4OnlineMoEMethod"),
        RuleSpec(ElementRule.COMPRESSED_TENSORS,
                 "gs = (6 * 448) / amax_tensor (1.0 for a zero tensor); s = e4m3(gs * (amax_block / 6)), 0 stored "
                 "as 0.125; q = e2m1(x / (s / gs))",
                 "compressed-tensors generate_gparam, calculate_qparams + NVFP4PackedCompressor"),
    ),
)

# The registry of presets, by name. Plain dict, built in one place.
FORMATS: dict[str, PrecisionFormat] = {f.name: f for f in (BF16, FP8_BLOCK, MXFP8, MXFP4, NVFP4)}


def format_by_name(name: str | None) -> PrecisionFormat:
    """Look a preset up by name, case-insensitively; None means BF16.

    Raises:
        KeyError: naming the valid presets.
    """
    if name is None:
        return BF16
    key = name.strip().upper().replace("-", "_")
    try:
        return FORMATS[key]
    except KeyError:
        raise KeyError(f"unknown precision format {name!r}; valid: {', '.join(FORMATS)}") from None
