"""The vLLM cells of the support matrix against vLLM's own code, on CPU (vLLM 0.32, `.venv-vllm`).

For each compressed-tensors cell the table (adapters/vllm/profile.py) marks CPU_ENGINE: vLLM's
dispatch reads the quantization_config the trainer sends (built by
adapters.compressed_tensors) and picks the scheme or expert method the table names; for the
shown cells, that scheme's `create_weights` allocates exactly the tensors the export sends (names,
stacked shapes, dtypes); for the rejected ones, the engine's reason is visible here: the static
`input_global_scale` NVFP4 allocates, the scheme that quantizes activations whatever the config
says, the FP8 key vLLM builds for MXFP8 activations, the AttributeError of FP8 weight-only experts.

The CPU build has no MX or NVFP4 kernels: kernel and expert-backend selection (which needs a GPU)
is replaced by a stand-in; the dispatch and the allocation under test are vLLM's. The schemes'
`create_weights` are the same in vLLM 0.32 and 0.33.0 (the lines the table cites).
"""

from __future__ import annotations

import importlib
import importlib.util
import socket
import types
from pathlib import Path
from unittest import mock

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm), which `make test` creates")
pytest.importorskip("compressed_tensors", reason="the quantization_config is built with compressed-tensors")

import torch

from adapters.compressed_tensors.quantization_config import compressed_tensors_config, to_config_json
from domain.quant.codecs import quantize_weight
from domain.quant.formats import FORMATS, ActivationScheme
from domain.quant.plan import QuantizationPlan
from domain.quant.support import COMPRESSED_TENSORS, CPU_ENGINE, Cell, Verdict
from tests.dispatching import verdicts

_SCH = "vllm.model_executor.layers.quantization.compressed_tensors.schemes."
_MOE = "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
# What needs a GPU: kernel and expert-backend selection. Replaced for the duration of this module.
_KERNELS = {
    _SCH + "compressed_tensors_w4a4_nvfp4": ("init_nvfp4_linear_kernel", "expose_input_quant_key"),
    _SCH + "compressed_tensors_w4a4_mxfp4": ("init_mxfp4_linear_kernel",),
    _SCH + "compressed_tensors_w8a8_mxfp8": ("init_mxfp8_linear_kernel",),
    _SCH + "compressed_tensors_w8a8_fp8": ("init_fp8_linear_kernel",),
    _SCH + "compressed_tensors_w8a16_fp8": ("init_wfp8_a16_linear_kernel",),
}
_BACKENDS = {
    _MOE + "compressed_tensors_moe_w4a4_nvfp4": "select_nvfp4_moe_backend",
    _MOE + "compressed_tensors_moe_w8a8_mxfp8": "select_mxfp8_moe_backend",
    "vllm.model_executor.layers.quantization.mxfp4": "select_deepseek_v4_mxfp4_moe_backend",
}
# The model dtype the FP8 schemes read from the current vLLM config (a bare VllmConfig has no model).
_MODEL_CONFIG = types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.bfloat16))
QKV = {"q_proj": 256, "k_proj": 128, "v_proj": 128}
K = 256
E, H, INTER = 4, 256, 128
ATTN = "model.layers.0.self_attn"
EXPERTS = "model.layers.0.mlp.experts"
CPU_CELLS = [v for v in verdicts().values()
             if v.cell.engine == "vllm" and v.cell.layout == COMPRESSED_TENSORS and CPU_ENGINE in v.how]


def _script():  # type: ignore[no-untyped-def]
    path = Path(__file__).resolve().parents[1] / "gpu" / "check_support_matrix.py"
    spec = importlib.util.spec_from_file_location("check_support_matrix", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


LAYOUTS = _script()


def _id(v: Verdict) -> str:
    return f"{v.cell.role}-{v.cell.fmt}-{v.cell.activation.value}-{'shown' if v.shown else 'rejected'}"


@pytest.fixture(scope="module", autouse=True)
def vllm_on_cpu():  # type: ignore[no-untyped-def]
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    started = not parallel_state.model_parallel_is_initialized()
    with set_current_vllm_config(VllmConfig()), pytest.MonkeyPatch.context() as mp:
        if started:  # vLLM's parameters read the tensor-parallel rank: one gloo process, world size 1
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            parallel_state.init_distributed_environment(
                world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=0, backend="gloo")
            parallel_state.initialize_model_parallel(1, 1)
        for module, names in _KERNELS.items():
            m = importlib.import_module(module)
            for name in names:
                mp.setattr(m, name, mock.MagicMock(name=name))
            if hasattr(m, "get_current_vllm_config"):
                mp.setattr(m, "get_current_vllm_config", lambda: _MODEL_CONFIG)
        for module, name in _BACKENDS.items():
            mp.setattr(importlib.import_module(module), name,
                       mock.MagicMock(name=name, return_value=(mock.MagicMock(), mock.MagicMock())))
        yield
        if started:
            parallel_state.destroy_model_parallel()
            parallel_state.destroy_distributed_environment()


def _plan(cell: Cell) -> QuantizationPlan:
    return QuantizationPlan.from_presets(**{cell.role: cell.fmt, f"{cell.role}_activation": cell.activation.value})


def _config(cell: Cell):  # type: ignore[no-untyped-def]
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    return CompressedTensorsConfig.from_config(to_config_json(compressed_tensors_config(_plan(cell))))


def _dense_scheme(cell: Cell):  # type: ignore[no-untyped-def]
    cfg = _config(cell)
    group = cfg.target_scheme_map["Linear"]
    return cfg, cfg._get_scheme_from_parts(group["weights"], group.get("input_activations"),
                                           format=group.get("format"), layer_name=f"{ATTN}.qkv_proj")


def _moe_method(cell: Cell):  # type: ignore[no-untyped-def]
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe import (
        CompressedTensorsMoEMethod,
    )

    moe = types.SimpleNamespace(moe_backend="auto", is_act_and_mul=True, w13_num_shards=2, max_capture_size=0)
    layer = types.SimpleNamespace(ckpt_gate_proj_name="gate_proj", ckpt_up_proj_name="up_proj",
                                  ckpt_down_proj_name="down_proj", moe_config=moe)
    return CompressedTensorsMoEMethod.get_moe_method(_config(cell), layer, EXPERTS)


def _params(module: torch.nn.Module, prefix: str) -> dict[str, tuple[list[int], str]]:
    return {f"{prefix}.{n}": (list(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in module.named_parameters()}


def _allocate_dense(scheme) -> dict[str, tuple[list[int], str]]:  # type: ignore[no-untyped-def]
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    layer = torch.nn.Module()
    scheme.create_weights(layer=layer, input_size_per_partition=K, output_partition_sizes=list(QKV.values()),
                          input_size=K, output_size=sum(QKV.values()), params_dtype=torch.bfloat16,
                          weight_loader=default_weight_loader)
    return _params(layer, f"{ATTN}.qkv_proj")


def _allocate_experts(method) -> dict[str, tuple[list[int], str]]:  # type: ignore[no-untyped-def]
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    layer = torch.nn.Module()
    method.create_weights(layer=layer, num_experts=E, hidden_size=H, intermediate_size_per_partition=INTER,
                          params_dtype=torch.bfloat16, weight_loader=default_weight_loader)
    return _params(layer, EXPERTS)


def _sent(named: dict[str, torch.Tensor], fmt: str) -> dict[str, tuple[list[int], str]]:
    """The checkpoint tensors the trainer sends for these weights (the codecs of quantize_stream)."""
    out = {}
    for name, w in named.items():
        for local, t in quantize_weight(FORMATS[fmt], w).tensors.items():
            out[f"{name.removesuffix('.weight')}.{local}"] = (list(t.shape), str(t.dtype).removeprefix("torch."))
    return out


def _export_dense(fmt: str) -> dict[str, tuple[list[int], str]]:
    g = torch.Generator().manual_seed(0)
    return _sent({f"{ATTN}.{p}.weight": torch.randn(n, K, generator=g) for p, n in QKV.items()}, fmt)


def _export_experts(fmt: str) -> dict[str, tuple[list[int], str]]:
    g = torch.Generator().manual_seed(0)
    named = {}
    for e in range(E):
        for proj, shape in (("gate_proj", (INTER, H)), ("up_proj", (INTER, H)), ("down_proj", (H, INTER))):
            named[f"{EXPERTS}.{e}.{proj}.weight"] = torch.randn(*shape, generator=g)
    return _sent(named, fmt)


# --- vLLM picks the scheme the table names ------------------------------------------------------------


@pytest.mark.parametrize("v", CPU_CELLS, ids=_id)
def test_vllm_picks_the_scheme_the_table_names(v: Verdict) -> None:
    c = v.cell
    if "AttributeError" in v.reason:
        with pytest.raises(AttributeError, match="num_bits"):
            _moe_method(c)
        return
    chosen = _dense_scheme(c)[1] if c.role == "linear" else _moe_method(c)
    assert v.engine_path.startswith(type(chosen).__name__), (type(chosen).__name__, v.engine_path)
    if c.fmt == "NVFP4":
        assert chosen.use_a16 is (c.activation is ActivationScheme.NONE)


# --- shown cells: the scheme allocates exactly what the export sends ------------------------------------


SHOWN_LINEAR = [v for v in CPU_CELLS if v.shown and v.cell.role == "linear"]
SHOWN_EXPERTS = [v for v in CPU_CELLS if v.shown and v.cell.role == "moe"]


@pytest.mark.parametrize("v", SHOWN_LINEAR, ids=_id)
def test_a_shown_linear_cell_allocates_what_the_export_sends(v: Verdict) -> None:
    allocated = _allocate_dense(_dense_scheme(v.cell)[1])
    expected = LAYOUTS.engine_layout(_export_dense(v.cell.fmt))
    assert LAYOUTS.compare_layouts(expected, allocated) == {"unexported": [], "unallocated": [], "shape": [], "dtype": []}
    assert set(allocated) == set(expected)


@pytest.mark.parametrize("v", SHOWN_EXPERTS, ids=_id)
def test_a_shown_expert_cell_allocates_what_the_export_sends(v: Verdict) -> None:
    allocated = _allocate_experts(_moe_method(v.cell))
    expected = LAYOUTS.engine_layout(_export_experts(v.cell.fmt))
    assert LAYOUTS.compare_layouts(expected, allocated) == {"unexported": [], "unallocated": [], "shape": [], "dtype": []}
    unsent = sorted(set(allocated) - set(expected))
    if v.cell.fmt == "NVFP4":  # the note: allocated, never sent, unused by the weight-only kernels
        assert unsent == [f"{EXPERTS}.w13_input_global_scale", f"{EXPERTS}.w2_input_global_scale"]
    else:
        assert unsent == []


def test_the_layout_check_sees_a_wrong_dtype() -> None:
    # Sensitivity: an export whose block scales had another dtype would be caught.
    cell = SHOWN_LINEAR[0].cell
    allocated = _allocate_dense(_dense_scheme(cell)[1])
    expected = LAYOUTS.engine_layout(_export_dense(cell.fmt))
    name = f"{ATTN}.qkv_proj.weight_scale"
    expected[name] = (expected[name][0], "bfloat16")
    assert LAYOUTS.compare_layouts(expected, allocated)["dtype"]


# --- rejected cells: the engine's reason, as vLLM's code shows it ---------------------------------------


def _cell(role: str, fmt: str, act: ActivationScheme) -> Cell:
    return Cell("vllm", COMPRESSED_TENSORS, role, fmt, act)


def test_per_token_nvfp4_linear_allocates_a_static_input_scale_the_export_lacks() -> None:
    allocated = _allocate_dense(_dense_scheme(_cell("linear", "NVFP4", ActivationScheme.NVFP4_PER_TOKEN))[1])
    diff = LAYOUTS.compare_layouts(LAYOUTS.engine_layout(_export_dense("NVFP4")), allocated)
    assert diff["unexported"] == [f"{ATTN}.qkv_proj.input_global_scale: float32 [3]"]


def test_per_token_nvfp4_experts_select_kernels_for_a_static_scale() -> None:
    method = _moe_method(_cell("moe", "NVFP4", ActivationScheme.NVFP4_PER_TOKEN))
    assert method.use_a16 is False
    allocated = _allocate_experts(method)
    assert f"{EXPERTS}.w13_input_global_scale" in allocated and f"{EXPERTS}.w2_input_global_scale" in allocated
    assert not any("input_global_scale" in n for n in _export_experts("NVFP4"))


@pytest.mark.parametrize(("role", "fmt", "default"), [("linear", "MXFP8", ActivationScheme.MXFP8),
                                                      ("linear", "MXFP4", ActivationScheme.MXFP4),
                                                      ("moe", "MXFP8", ActivationScheme.MXFP8),
                                                      ("moe", "MXFP4", ActivationScheme.MXFP4)])
def test_mx_weight_only_gets_the_scheme_that_quantizes_activations(role: str, fmt: str, default: ActivationScheme) -> None:
    pick = (lambda c: _dense_scheme(c)[1]) if role == "linear" else _moe_method
    assert type(pick(_cell(role, fmt, ActivationScheme.NONE))) is type(pick(_cell(role, fmt, default)))


def test_mxfp8_activations_of_mxfp4_linear_become_an_fp8_key_with_float32_scales() -> None:
    from vllm.model_executor.layers.quantization.utils.quant_utils import kMxfp8Dynamic

    cfg, scheme = _dense_scheme(_cell("linear", "MXFP4", ActivationScheme.MXFP8))
    key = cfg._fp8_dynamic_input_key(cfg.target_scheme_map["Linear"]["input_activations"])
    assert type(scheme).__name__ == "CompressedTensorsW4A8Mxfp4"
    assert key != kMxfp8Dynamic and key.scale.dtype == torch.float32 and kMxfp8Dynamic.scale.dtype != torch.float32
