"""The GDN adapter without megatron-core: kernel selection, patch mechanics, input checks.

`FakeOldGdn` is a plain-torch module with the attributes of Megatron-Core's pre-0.18
GatedDeltaNet and its behaviour on packed input (NotImplementedError). The numerical claims
against the real layer live in tests/integration/test_megatron_gdn.py.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from adapters.megatron import gdn
from adapters.megatron.gdn_forward import check_packed_input, packed_forward
from adapters.megatron.gdn_kernels import GdnKernels, causal_conv1d_kernels, reference_kernels, select_kernels
from adapters.megatron.packed_gdn import apply_packed_gdn, remove_packed_gdn
from domain.errors import InvalidPackedBoundaries, PackedGdnUnsupported
from domain.forward import varlen_kernels
from domain.forward.gdn_packing import build_seq_idx

HIDDEN, HEADS_K, HEADS_V, DK, DV = 16, 1, 2, 4, 4


class _Projection(torch.nn.Linear):
    def forward(self, x):  # Megatron's parallel linears return (output, bias)
        return super().forward(x), None


class FakeOldGdn(torch.nn.Module):
    """Pre-0.18 GatedDeltaNet: same attributes, packed input rejected."""

    def __init__(self, layer_number: int = 1) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.config = types.SimpleNamespace(deterministic_mode=False)
        self.tp_size, self.sp_size = 1, 1
        self.key_head_dim, self.value_head_dim = DK, DV
        self.num_key_heads, self.num_value_heads = HEADS_K, HEADS_V
        self.qk_dim, self.v_dim = DK * HEADS_K, DV * HEADS_V
        self.use_qk_l2norm, self.activation = True, "silu"
        conv_dim = 2 * self.qk_dim + self.v_dim
        self.in_proj = _Projection(HIDDEN, conv_dim + self.v_dim + 2 * HEADS_V, bias=False)
        self.conv1d = torch.nn.Conv1d(conv_dim, conv_dim, 4, groups=conv_dim, padding=3, bias=True)
        self.A_log = torch.nn.Parameter(torch.rand(HEADS_V).log())
        self.dt_bias = torch.nn.Parameter(torch.ones(HEADS_V))
        self.out_norm = torch.nn.RMSNorm(DV, eps=1e-5)
        self.out_proj = _Projection(self.v_dim, HIDDEN, bias=False)

    def _apply_gated_norm(self, x, gate):
        y = self.out_norm(x.reshape(-1, x.shape[-1]))
        return (y * F.silu(gate.reshape(-1, gate.shape[-1]).float())).to(x.dtype)

    def forward(self, hidden_states, attention_mask, packed_seq_params=None, **kwargs):
        if packed_seq_params is not None:
            raise NotImplementedError("GDN does not support packed sequence for now.")
        return "original", hidden_states


def params(cu_q, cu_q_padded=None, **extra):
    fields = {"qkv_format": "thd", "cu_seqlens_q": cu_q, "cu_seqlens_q_padded": cu_q_padded}
    return types.SimpleNamespace(**(fields | extra))


def cu(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


@pytest.fixture(autouse=True)
def _unpatch():
    yield
    gdn.unpatch_gdn_forward(FakeOldGdn)


# --- detection and the patch --------------------------------------------------------------------


def test_fake_old_class_is_not_native_and_a_backport_is() -> None:
    assert not gdn.detect_native_packed_gdn(FakeOldGdn, version="0.17.1").native
    backport = type("Backport", (FakeOldGdn,), {"_resolve_cu_seqlens": lambda self, *a: None})
    support = gdn.detect_native_packed_gdn(backport, version="0.17.1")
    assert support.native and support.version == "0.17.1"
    assert gdn.patch_gdn_forward(backport, kernels="reference") is False


def test_patched_fake_runs_packed_input_and_delegates_the_rest() -> None:
    layer = FakeOldGdn()
    x = torch.randn(64, 1, HIDDEN)
    with pytest.raises(NotImplementedError):
        layer(x, None, packed_seq_params=params(cu(0, 32, 64)))
    assert gdn.patch_gdn_forward(FakeOldGdn, kernels="reference")
    out, bias = layer(x, None, packed_seq_params=params(cu(0, 32, 64)))
    assert out.shape == (64, 1, HIDDEN) and bias is None
    assert layer(x, None) == ("original", x)  # not packed: the original forward
    sbhd = types.SimpleNamespace(qkv_format="sbhd")
    with pytest.raises(NotImplementedError):  # not thd: left to the original, which rejects it
        layer(x, None, packed_seq_params=sbhd)


def test_packed_samples_equal_the_same_samples_packed_alone() -> None:
    layer = FakeOldGdn()
    gdn.patch_gdn_forward(FakeOldGdn, kernels=reference_kernels())
    x = torch.randn(96, 1, HIDDEN)
    packed, _ = layer(x, None, packed_seq_params=params(cu(0, 32, 96)))
    first, _ = layer(x[:32], None, packed_seq_params=params(cu(0, 32)))
    second, _ = layer(x[32:], None, packed_seq_params=params(cu(0, 64)))
    assert torch.equal(packed, torch.cat([first, second]))


def test_undo_of_an_inherited_forward_restores_inheritance() -> None:
    child = type("Child", (FakeOldGdn,), {})
    assert "forward" not in child.__dict__
    gdn.patch_gdn_forward(child, kernels="reference")
    assert gdn.is_gdn_patched(child) and not gdn.is_gdn_patched(FakeOldGdn)
    assert gdn.unpatch_gdn_forward(child)
    assert "forward" not in child.__dict__
    assert child.forward is FakeOldGdn.forward


def test_repatching_swaps_kernels_only() -> None:
    calls: list[str] = []

    def counting_rule(q, k, v, g, beta, cu_seqlens):
        calls.append("rule")
        return varlen_kernels.gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens)

    gdn.patch_gdn_forward(FakeOldGdn, kernels="reference")
    forward = FakeOldGdn.__dict__["forward"]
    counting = GdnKernels("counting", reference_kernels().conv, counting_rule, varlen_kernels.l2norm)
    gdn.patch_gdn_forward(FakeOldGdn, kernels=counting)
    assert FakeOldGdn.__dict__["forward"] is forward
    FakeOldGdn()(torch.randn(32, 1, HIDDEN), None, packed_seq_params=params(cu(0, 32)))
    assert calls == ["rule"]


# --- input checks ---------------------------------------------------------------------------


def test_boundaries_must_end_at_the_sequence_parallel_gathered_length() -> None:
    layer = FakeOldGdn()
    layer.sp_size = 2
    x = torch.randn(8, 1, HIDDEN)  # 8 local tokens, 16 after the gather
    boundaries, total = check_packed_input(layer, x, params(cu(0, 6, 16)))
    assert total == 16 and boundaries.tolist() == [0, 6, 16]
    with pytest.raises(InvalidPackedBoundaries, match="ends at 8 but the packed sequence has 16"):
        check_packed_input(layer, x, params(cu(0, 8)))


def test_padded_boundaries_win_and_kv_must_agree() -> None:
    layer, x = FakeOldGdn(), torch.randn(8, 1, HIDDEN)
    boundaries, _ = check_packed_input(layer, x, params(cu(0, 3, 5), cu(0, 4, 8)))
    assert boundaries.tolist() == [0, 4, 8]
    with pytest.raises(InvalidPackedBoundaries, match="cu_seqlens_kv: differs from cu_seqlens_q"):
        check_packed_input(layer, x, params(cu(0, 4, 8), cu_seqlens_kv=cu(0, 2, 8)))
    with pytest.raises(InvalidPackedBoundaries, match="cu_seqlens_q_padded: decreases"):
        check_packed_input(layer, x, params(cu(0, 4, 8), cu(0, 6, 4, 8)))


def test_batch_above_one_and_context_parallel_are_typed_errors() -> None:
    layer = FakeOldGdn()
    with pytest.raises(PackedGdnUnsupported, match="batch dimension 1"):
        check_packed_input(layer, torch.randn(8, 2, HIDDEN), params(cu(0, 8)))
    layer.cp_size = 2
    with pytest.raises(PackedGdnUnsupported, match="context_parallel_size=2") as info:
        packed_forward(layer, torch.randn(8, 1, HIDDEN), params(cu(0, 16)), reference_kernels())
    assert isinstance(info.value, NotImplementedError)


# --- kernel sets ----------------------------------------------------------------------------


def test_select_kernels() -> None:
    assert select_kernels("reference").name == "reference"
    assert select_kernels("auto", device="cpu").name == "reference"
    ready = reference_kernels()
    assert select_kernels(ready) is ready
    with pytest.raises(ValueError, match="'triton' is not one of"):
        select_kernels("triton")


def test_missing_packages_name_the_adapter_and_the_package(monkeypatch) -> None:
    for name in (
        "causal_conv1d",
        "fla.ops.gated_delta_rule",
        "fla.modules.l2norm",
        "fla.modules.causal_conv1d",
    ):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ModuleNotFoundError, match=r"adapters\.megatron\.gdn_kernels") as info:
        select_kernels("fla")
    assert info.value.name == "fla"
    with pytest.raises(ModuleNotFoundError) as info:
        select_kernels("auto", device="cuda")  # neither fla nor causal-conv1d: fla is named
    assert info.value.name == "fla"


def test_causal_conv1d_fallback_passes_channel_last_input_and_seq_idx(monkeypatch) -> None:
    seen = {}

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, activation=None):
        # The package's kernel: [B, D, T] in channel-last memory, int32 seq_idx [B, T].
        seen["channel_last"] = x.stride(1) == 1
        seen["seq_idx"] = (seq_idx.dtype, tuple(seq_idx.shape))
        out = varlen_kernels.causal_conv1d(x.transpose(1, 2), weight, bias, activation, seq_idx=seq_idx)
        return out.transpose(1, 2)

    monkeypatch.setitem(
        sys.modules, "causal_conv1d", types.SimpleNamespace(causal_conv1d_fn=causal_conv1d_fn)
    )
    fla_rule = types.SimpleNamespace(chunk_gated_delta_rule=lambda *a, **k: None)
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fla_rule)
    monkeypatch.setitem(
        sys.modules, "fla.modules.l2norm", types.SimpleNamespace(l2norm=varlen_kernels.l2norm)
    )
    monkeypatch.setitem(sys.modules, "fla.modules.causal_conv1d", None)  # fla without varlen conv

    kernels = select_kernels("auto", device="cuda")
    assert kernels.name == "causal_conv1d"
    assert causal_conv1d_kernels().name == "causal_conv1d"
    boundaries = cu(0, 5, 12)
    seq_idx = build_seq_idx(boundaries, 12)
    x, weight, bias = torch.randn(1, 12, 6), torch.randn(6, 4), torch.randn(6)
    out = kernels.conv(x, weight, bias, "silu", boundaries, seq_idx)
    assert seen == {"channel_last": True, "seq_idx": (torch.int32, (1, 12))}
    assert torch.equal(out, varlen_kernels.causal_conv1d(x, weight, bias, "silu", seq_idx=seq_idx))


# --- the service without megatron-core --------------------------------------------------------


def test_service_finds_fake_layers_and_patches_for_the_model_device() -> None:
    model = [torch.nn.Sequential(FakeOldGdn(1)), torch.nn.Sequential(torch.nn.Linear(2, 2), FakeOldGdn(2))]
    report = apply_packed_gdn(model, gdn_class=FakeOldGdn)
    assert report.mode == "patched" and report.kernels == "reference"
    assert report.layers == ("0.0", "1.1")
    assert gdn.is_gdn_patched(FakeOldGdn)
    remove_packed_gdn(model, gdn_class=FakeOldGdn)
    assert not gdn.is_gdn_patched(FakeOldGdn)


def test_service_without_megatron_core_reports_nothing_to_do(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "megatron.core.ssm.gated_delta_net", None)
    with pytest.raises(ModuleNotFoundError, match=r"adapters\.megatron\.gdn needs megatron-core"):
        gdn.megatron_gdn_class()
    report = apply_packed_gdn(torch.nn.Linear(2, 2))
    assert report.mode == "none" and "not installed" in report.reason


# --- the GPU check script's harness, run on CPU with the reference kernels -----------------------


def test_gpu_check_harness_runs_on_cpu() -> None:
    from tests.gpu.check_gdn_fla import main, run_checks

    results = run_checks(device="cpu", kernels=reference_kernels(), quick=True)
    assert results and all(r.ok for r in results)
    for r in results:
        if "float32" in r.name:  # the reference against itself, packed vs per sequence
            assert r.max_abs_diff == 0.0, r.line()
        if r.name.endswith(" fwd"):
            assert r.leak > 0.1, r.line()
    if not torch.cuda.is_available():
        assert main([]) == 2  # standalone without CUDA: says so and exits 2


# --- one validation per batch, no host read in the layers --------------------------------------


class CountingReads(torch.Tensor):
    """Counts the host reads of its values (the operations NoHostSync refuses)."""

    reads = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        from tests.unit.test_gdn_packing import _SYNCING

        if func in _SYNCING:
            CountingReads.reads += 1
        return super().__torch_function__(func, types, args, kwargs or {})


class Model(torch.nn.Module):
    """Three GDN layers behind a forward that takes packed_seq_params, as GPTModel does."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(FakeOldGdn(i + 1) for i in range(3))
        self.reads_at_entry: int | None = None

    def forward(self, hidden_states, packed_seq_params=None):
        self.reads_at_entry = CountingReads.reads
        for layer in self.layers:
            hidden_states, _ = layer(hidden_states, None, packed_seq_params=packed_seq_params)
        return hidden_states


def _no_sync_params(values_q: tuple[int, ...], values_padded: tuple[int, ...]):  # type: ignore[no-untyped-def]
    from tests.unit.test_gdn_packing import no_sync

    q, padded = no_sync(cu(*values_q)), no_sync(cu(*values_padded))
    return params(q, padded, cu_seqlens_kv=q, cu_seqlens_kv_padded=padded)


def test_a_batch_validated_where_it_is_built_runs_every_layer_without_a_host_read() -> None:
    from adapters.megatron.gdn_forward import validate_packed_seq_params

    model = Model()
    gdn.patch_gdn_forward(FakeOldGdn, kernels="reference")
    x = torch.randn(64, 1, HIDDEN)
    reference = model(x, packed_seq_params=params(cu(0, 20, 50), cu(0, 32, 64)))
    batch = _no_sync_params((0, 20, 50), (0, 32, 64))  # any host read of these raises HostSync
    record = validate_packed_seq_params(batch, values=(0, 32, 64))  # the builder's host integers
    assert record.values == (0, 32, 64) and record.name == "cu_seqlens_q_padded"
    out = model(x, packed_seq_params=batch)  # three patched layers
    assert torch.equal(out.as_subclass(torch.Tensor), reference)
    # natively packed-aware versions: the validation hook of each layer reads nothing either
    for layer in model.layers:
        gdn._validation_hook(layer, (x, None), {"packed_seq_params": batch})
    # sensitivity: without the batch's record a layer reads the boundaries, and the detector says so
    from adapters.megatron.gdn_forward import BOUNDARIES_ATTR
    from tests.unit.test_gdn_packing import HostSync

    delattr(batch, BOUNDARIES_ATTR)
    with pytest.raises(HostSync):
        model.layers[0](x, None, packed_seq_params=batch)


def test_a_batch_built_elsewhere_is_read_once_at_the_models_entry() -> None:
    model = Model()
    apply_packed_gdn(model, gdn_class=FakeOldGdn, kernels="reference")
    counting = cu(0, 32, 64).as_subclass(CountingReads)
    batch = params(counting, cu_seqlens_kv=counting)
    CountingReads.reads = 0
    model(torch.randn(64, 1, HIDDEN), packed_seq_params=batch)
    assert (model.reads_at_entry, CountingReads.reads) == (1, 1)  # once, before the first layer
    model(torch.randn(64, 1, HIDDEN), packed_seq_params=batch)
    assert CountingReads.reads == 1  # the same batch again: validated already
    remove_packed_gdn(model, gdn_class=FakeOldGdn)
    assert not gdn.remove_batch_validation(model)


def test_layers_called_directly_validate_once_per_batch_not_per_layer() -> None:
    gdn.patch_gdn_forward(FakeOldGdn, kernels="reference")
    layers = [FakeOldGdn(i) for i in range(4)]
    counting = cu(0, 16, 32).as_subclass(CountingReads)
    batch = params(counting)
    CountingReads.reads = 0
    x = torch.randn(32, 1, HIDDEN)
    for layer in layers:
        x, _ = layer(x, None, packed_seq_params=batch)
    assert CountingReads.reads == 1


def test_a_replaced_boundary_tensor_is_validated_again() -> None:
    layer, x = FakeOldGdn(), torch.randn(8, 1, HIDDEN)
    batch = params(cu(0, 4, 8))
    check_packed_input(layer, x, batch)
    batch.cu_seqlens_q = cu(0, 8, 4)
    with pytest.raises(InvalidPackedBoundaries, match="decreases"):
        check_packed_input(layer, x, batch)
