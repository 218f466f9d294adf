"""A checkpoint passed through untouched must hold the layout its quantization_config says, from
its headers: no BF16 weight the config quantizes, no quantized weight without its scales, the
packing of the config's bit width."""

from __future__ import annotations

import pytest
import torch

from domain.errors import CheckpointError, NativeLayoutMismatch
from domain.quant.native_layout import check_native_tensors

E = "model.layers.0.mlp.experts"
Q = "model.layers.0.self_attn.q_proj"
GPT_OSS = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
BF16_ATTENTION = [(f"{Q}.weight", (64, 64), torch.bfloat16), ("lm_head.weight", (32, 64), torch.bfloat16)]


def _mxfp4(blocks=(4, 64, 2, 16), scales=(4, 64, 2), scale_dtype=torch.uint8):
    return [(f"{E}.gate_up_proj_blocks", blocks, torch.uint8), (f"{E}.gate_up_proj_scales", scales, scale_dtype)]


def _refused(qc: dict, method: str, specs: list, *words: str) -> None:
    with pytest.raises(NativeLayoutMismatch) as err:
        check_native_tensors(qc, method, specs)
    assert isinstance(err.value, CheckpointError) and err.value.tensor in str(err.value)
    for word in words:
        assert word in str(err.value), (word, str(err.value))


def test_gpt_oss_experts_with_bf16_attention_are_what_mxfp4_says() -> None:
    check_native_tensors(GPT_OSS, "mxfp4", [*BF16_ATTENTION, *_mxfp4()])


def test_mxfp4_over_bf16_experts_is_refused() -> None:
    specs = [*BF16_ATTENTION, (f"{E}.gate_up_proj", (4, 128, 64), torch.bfloat16)]
    _refused(GPT_OSS, "mxfp4", specs, f"'{E}.gate_up_proj' is stored as bfloat16", "quant_method 'mxfp4'")


@pytest.mark.parametrize(("specs", "words"), [
    (_mxfp4(scales=(4, 64, 3)), ("needs uint8 scales [4, 64, 2]",)),
    (_mxfp4(scale_dtype=torch.float32), ("found float32",)),
    (_mxfp4(blocks=(4, 64, 2, 8), scales=(4, 64, 2)), ("uint8 [..., 16]",)),
    (_mxfp4()[:1], ("found none",)),
])
def test_mxfp4_blocks_need_one_e8m0_scale_each(specs: list, words: tuple[str, ...]) -> None:
    _refused(GPT_OSS, "mxfp4", [*BF16_ATTENTION, *specs], *words)


def test_fp8_weights_need_their_scales() -> None:
    qc = {"quant_method": "fp8", "weight_block_size": [64, 64]}
    check_native_tensors(qc, "fp8", [(f"{Q}.weight", (64, 64), torch.float8_e4m3fn),
                                     (f"{Q}.weight_scale_inv", (1, 1), torch.float32)])
    _refused(qc, "fp8", [(f"{Q}.weight", (64, 64), torch.float8_e4m3fn)], "without", "weight_scale")


def test_awq_packs_along_n() -> None:
    qc = {"quant_method": "awq", "bits": 4, "group_size": 64}
    good = [(f"{Q}.qweight", (128, 32), torch.int32), (f"{Q}.scales", (2, 256), torch.float16),
            (f"{Q}.qzeros", (2, 32), torch.int32)]
    check_native_tensors(qc, "awq", good)
    _refused({**qc, "bits": 8}, "awq", good, "not the 8-bit awq packing")
    _refused(qc, "awq", [(f"{Q}.qweight", (128, 32), torch.int64), *good[1:]], "awq packs weights into int32")


def test_a_compressed_tensors_layout_of_another_bit_width_is_refused() -> None:
    w4a16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
             "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                                     "group_size": 32}}}}
    packed = [(f"{Q}.weight_packed", (64, 8), torch.int32), (f"{Q}.weight_scale", (64, 2), torch.bfloat16),
              (f"{Q}.weight_shape", (2,), torch.int64), ("lm_head.weight", (32, 64), torch.bfloat16)]
    check_native_tensors(w4a16, "compressed-tensors", packed)
    one_byte = [(f"{Q}.weight", (64, 64), torch.int8), *packed[1:]]
    _refused(w4a16, "compressed-tensors", one_byte, "one value per byte", "4 bits")
    _refused(w4a16, "compressed-tensors", [packed[0], packed[3]], "without", "weight_scale")
    # lm_head is the output head, which no config quantizes: BF16 even where the ignore list omits it
    check_native_tensors({**w4a16, "ignore": []}, "compressed-tensors", packed)
