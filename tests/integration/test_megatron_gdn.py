"""Packed GDN with real megatron-core on CPU: a small GatedDeltaNet layer, reference kernels.

megatron-core 0.19.2 handles packed GDN natively, so the packed-aware forward (for versions before
0.18) is tested by patching the installed class explicitly (`force=True`) and by a fake older
class: a subclass that lacks the packed boundary resolver and rejects packed input, as those
versions do. The per-sequence oracle is Megatron's own forward, run on one sequence at a time,
with its fla kernels (Triton, no CPU) swapped for the library's plain-torch references.

Bit-identity against per-sequence runs holds for 32-token-aligned sample slots (the MXFP8
alignment): with other lengths Megatron's own CPU ops (a matrix product of one row, SIMD tails of
elementwise gates) round a few values by one ulp differently from a packed run. The packed
forward equals Megatron's native packed forward bit for bit at any length.
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (the `megatron` extra)")
pytest.importorskip("fla", reason="megatron-core's GatedDeltaNet needs flash-linear-attention")

from adapters.megatron import gdn as gdn_adapter
from adapters.megatron.gdn_kernels import reference_kernels
from adapters.megatron.packed_gdn import apply_packed_gdn, remove_packed_gdn
from app import bootstrap
from domain.errors import ConfigError, InvalidPackedBoundaries, PackedGdnDeterministic
from domain.forward import varlen_kernels
from domain.forward.gdn_packing import build_seq_idx
from tests.megatron_cpu import megatron_cpu_env  # noqa: F401

pytestmark = pytest.mark.megatron

HIDDEN = 32
ALIGN = 32


@pytest.fixture(autouse=True)
def _eager():
    # megatron-core wraps GDN helpers in torch.compile; run them eagerly on CPU.
    with torch.compiler.set_stance("force_eager"):
        yield


@pytest.fixture(scope="module")
def mc(megatron_cpu_env):  # noqa: F811
    """Megatron modules and the layer classes: the installed one and a fake pre-0.18 one."""
    import megatron.core.ssm.gated_delta_net.common as common
    import megatron.core.ssm.gated_delta_net.gdn as gdn_module
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    class OldGatedDeltaNet(GatedDeltaNet):
        """GatedDeltaNet as Megatron-Core < 0.18 has it: no packed boundary resolution, packed
        input rejected, and the older forward signature (key_value_states, attention_bias)."""

        _resolve_cu_seqlens = None

        def forward(
            self,
            hidden_states,
            attention_mask,
            key_value_states=None,
            inference_context=None,
            attention_bias=None,
            packed_seq_params=None,
            sequence_len_offset=None,
            *,
            inference_params=None,
            **kwargs,
        ):
            if packed_seq_params is not None:
                raise NotImplementedError("GDN does not support packed sequence for now.")
            return super().forward(hidden_states, attention_mask, inference_context=inference_context)

    def build(cls=GatedDeltaNet, seed: int = 0, **overrides):
        torch.manual_seed(seed)
        config = TransformerConfig(
            num_layers=1,
            hidden_size=HIDDEN,
            num_attention_heads=4,
            use_cpu_initialization=True,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            normalization="RMSNorm",
            activation_func=torch.nn.functional.silu,
            **overrides,
        )
        submodules = GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=WrappedTorchNorm, out_proj=RowParallelLinear
        )
        pg = ProcessGroupCollection.use_mpu_process_groups()
        return cls(config, submodules, layer_number=1, conv_bias=True, pg_collection=pg)

    return types.SimpleNamespace(
        GatedDeltaNet=GatedDeltaNet,
        OldGatedDeltaNet=OldGatedDeltaNet,
        PackedSeqParams=PackedSeqParams,
        gdn_module=gdn_module,
        common=common,
        build=build,
    )


@pytest.fixture(autouse=True)
def _restore(request):
    yield
    if "mc" in request.fixturenames:
        mc = request.getfixturevalue("mc")
        gdn_adapter.unpatch_gdn_forward(mc.GatedDeltaNet)
        gdn_adapter.unpatch_gdn_forward(mc.OldGatedDeltaNet)


def _fla_conv(
    x, weight, bias=None, activation=None, initial_state=None, output_final_state=False, cu_seqlens=None, **_
):
    seq_idx = None if cu_seqlens is None else build_seq_idx(cu_seqlens, x.shape[1])
    return varlen_kernels.causal_conv1d(x, weight, bias, activation, seq_idx=seq_idx), None


def _fla_rule(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    return varlen_kernels.gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens), None


@pytest.fixture
def upstream_on_cpu(mc, monkeypatch):
    """Megatron's own forward with its fla kernels replaced by the plain-torch references."""
    monkeypatch.setattr(mc.gdn_module, "causal_conv1d", _fla_conv)
    monkeypatch.setattr(mc.common, "l2norm", varlen_kernels.l2norm)

    def prepare(layer):
        monkeypatch.setattr(layer, "gated_delta_rule", _fla_rule)
        return layer

    return prepare


def layout(seed: int, align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random actual lengths (1..64, 3 to 5 samples) and their slots padded to `align`."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 65, (int(torch.randint(3, 6, (1,), generator=gen)),), generator=gen)
    slots = (lengths + align - 1) // align * align
    zero = torch.zeros(1, dtype=torch.int32)
    return (
        torch.cat([zero, lengths.cumsum(0).to(torch.int32)]),
        torch.cat([zero, slots.cumsum(0).to(torch.int32)]),
    )


def packed_params(mc, cu_q: torch.Tensor, cu_q_padded: torch.Tensor | None = None):
    return mc.PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_q,
        cu_seqlens_q_padded=cu_q_padded,
        cu_seqlens_kv_padded=cu_q_padded,
        max_seqlen_q=64,
        max_seqlen_kv=64,
    )


def per_sequence(layer, x: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    bounds = cu.tolist()
    return torch.cat([layer(x[a:b], None)[0] for a, b in itertools.pairwise(bounds)])


# --- detection ---------------------------------------------------------------------------------


def test_installed_megatron_core_is_detected_as_native(mc) -> None:
    support = gdn_adapter.detect_native_packed_gdn(mc.GatedDeltaNet)
    assert support.native
    assert support.version.startswith("0.19")
    assert gdn_adapter.megatron_gdn_class() is mc.GatedDeltaNet
    assert gdn_adapter.patch_gdn_forward(mc.GatedDeltaNet, kernels="reference") is False
    assert not gdn_adapter.is_gdn_patched(mc.GatedDeltaNet)


def test_fake_older_class_is_detected_as_needing_the_patch(mc) -> None:
    support = gdn_adapter.detect_native_packed_gdn(mc.OldGatedDeltaNet, version="0.17.0")
    assert not support.native and "< 0.18" in support.reason
    layer = mc.build(mc.OldGatedDeltaNet)
    cu = torch.tensor([0, 32, 64], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="does not support packed sequence"):
        layer(torch.randn(64, 1, HIDDEN), None, packed_seq_params=packed_params(mc, cu))


# --- packed == per sequence ---------------------------------------------------------------------


def test_old_class_patched_by_the_service_packed_equals_per_sequence(mc, upstream_on_cpu) -> None:
    layer = upstream_on_cpu(mc.build(mc.OldGatedDeltaNet, seed=3))
    model = torch.nn.ModuleDict({"mixer": layer, "head": torch.nn.Linear(2, 2)})
    report = apply_packed_gdn(model, gdn_class=mc.OldGatedDeltaNet)
    assert (report.mode, report.layers, report.kernels) == ("patched", ("mixer",), "reference")

    cu_q, cu_padded = layout(seed=3, align=ALIGN)
    x = torch.randn(int(cu_padded[-1]), 1, HIDDEN)
    # packed_seq_params passed positionally, in the older signature's sixth slot.
    packed, bias = layer(x, None, None, None, None, packed_params(mc, cu_q, cu_padded))
    assert bias is None
    assert torch.equal(packed, per_sequence(layer, x, cu_padded))

    remove_packed_gdn(model, gdn_class=mc.OldGatedDeltaNet)
    with pytest.raises(NotImplementedError):
        layer(x, None, packed_seq_params=packed_params(mc, cu_q, cu_padded))


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_forced_patch_on_installed_class_packed_equals_per_sequence(
    mc, upstream_on_cpu, seed, padded
) -> None:
    layer = upstream_on_cpu(mc.build(seed=seed))
    assert gdn_adapter.patch_gdn_forward(mc.GatedDeltaNet, kernels="reference", force=True)
    cu_q, cu_padded = layout(seed, align=ALIGN)
    params = packed_params(mc, cu_q, cu_padded) if padded else packed_params(mc, cu_padded)
    x = torch.randn(int(cu_padded[-1]), 1, HIDDEN)
    packed, _ = layer(x, None, packed_seq_params=params)
    assert packed.shape == x.shape
    assert torch.equal(packed, per_sequence(layer, x, cu_padded))


def test_patched_forward_equals_native_packed_forward_at_any_length(mc, upstream_on_cpu) -> None:
    layer = upstream_on_cpu(mc.build(seed=5))
    cu_q, _ = layout(seed=5, align=1)
    x = torch.randn(int(cu_q[-1]), 1, HIDDEN, requires_grad=True)
    params = packed_params(mc, cu_q)

    native, _ = layer(x, None, packed_seq_params=params)
    native_grads = torch.autograd.grad(native.square().sum(), [x, *layer.parameters()])
    gdn_adapter.patch_gdn_forward(mc.GatedDeltaNet, kernels="reference", force=True)
    ours, _ = layer(x, None, packed_seq_params=params)
    our_grads = torch.autograd.grad(ours.square().sum(), [x, *layer.parameters()])

    assert torch.equal(ours, native)
    for got, want in zip(our_grads, native_grads, strict=True):
        assert torch.equal(got, want)
    # Unaligned lengths: per-sequence runs agree to rounding (see the module docstring).
    torch.testing.assert_close(ours, per_sequence(layer, x.detach(), cu_q), rtol=1e-5, atol=1e-6)


def test_samples_do_not_leak_into_each_other(mc, upstream_on_cpu) -> None:
    layer = upstream_on_cpu(mc.build(seed=7))
    gdn_adapter.patch_gdn_forward(mc.GatedDeltaNet, kernels="reference", force=True)
    cu = torch.tensor([0, 32, 64], dtype=torch.int32)
    x = torch.randn(64, 1, HIDDEN)
    changed = x.clone()
    changed[:32] = torch.randn(32, 1, HIDDEN)  # only the first sample differs
    first, _ = layer(x, None, packed_seq_params=packed_params(mc, cu))
    second, _ = layer(changed, None, packed_seq_params=packed_params(mc, cu))
    assert torch.equal(first[32:], second[32:])
    assert not torch.equal(first[:32], second[:32])


def test_non_packed_calls_still_run_the_original_forward(mc, upstream_on_cpu) -> None:
    layer = upstream_on_cpu(mc.build(seed=2))
    x = torch.randn(40, 2, HIDDEN)
    before, _ = layer(x, None)
    gdn_adapter.patch_gdn_forward(mc.GatedDeltaNet, kernels="reference", force=True)
    after, _ = layer(x, None)
    assert torch.equal(before, after)


# --- patch mechanics ----------------------------------------------------------------------------


def test_patch_is_idempotent_and_undo_restores_the_backup(mc) -> None:
    original = mc.GatedDeltaNet.__dict__["forward"]
    assert gdn_adapter.patch_gdn_forward(mc.GatedDeltaNet, kernels="reference", force=True)
    patched = mc.GatedDeltaNet.__dict__["forward"]
    assert patched is not original
    assert gdn_adapter.patch_gdn_forward(mc.GatedDeltaNet, kernels=reference_kernels(), force=True)
    assert mc.GatedDeltaNet.__dict__["forward"] is patched
    assert gdn_adapter.is_gdn_patched(mc.GatedDeltaNet)
    assert gdn_adapter.unpatch_gdn_forward(mc.GatedDeltaNet)
    assert mc.GatedDeltaNet.__dict__["forward"] is original
    assert not gdn_adapter.unpatch_gdn_forward(mc.GatedDeltaNet)
    assert mc.GatedDeltaNet.__dict__["forward"] is original


# --- validation and rejection -------------------------------------------------------------------


def test_deterministic_mode_with_packed_input_is_rejected(mc, monkeypatch) -> None:
    layer = mc.build(seed=1)
    monkeypatch.setattr(layer.config, "deterministic_mode", True)
    cu = torch.tensor([0, 32, 64], dtype=torch.int32)
    x = torch.randn(64, 1, HIDDEN)
    # Native Megatron-Core with the validation hook: a typed error before Megatron's assert.
    assert gdn_adapter.install_packed_validation(layer)
    with pytest.raises(PackedGdnDeterministic, match="not varlen-aware"):
        layer(x, None, packed_seq_params=packed_params(mc, cu))
    gdn_adapter.remove_packed_validation(layer)
    # The packed-aware forward rejects it too.
    gdn_adapter.patch_gdn_forward(mc.GatedDeltaNet, kernels="reference", force=True)
    with pytest.raises(PackedGdnDeterministic, match="deterministic_mode=false"):
        layer(x, None, packed_seq_params=packed_params(mc, cu))


def test_service_on_native_megatron_only_validates(mc, upstream_on_cpu) -> None:
    layer = upstream_on_cpu(mc.build(seed=4))
    model = torch.nn.Sequential(layer)
    report = apply_packed_gdn(model)
    assert (report.mode, report.layers, report.kernels) == ("native", ("0",), None)
    assert not gdn_adapter.is_gdn_patched(mc.GatedDeltaNet)
    assert not gdn_adapter.install_packed_validation(layer)  # already there: idempotent

    x = torch.randn(64, 1, HIDDEN)
    with pytest.raises(
        InvalidPackedBoundaries, match="cu_seqlens_q: ends at 48 but the packed sequence has 64"
    ):
        layer(x, None, packed_seq_params=packed_params(mc, torch.tensor([0, 32, 48], dtype=torch.int32)))
    cu = torch.tensor([0, 32, 64], dtype=torch.int32)
    packed, _ = layer(x, None, packed_seq_params=packed_params(mc, cu))
    assert torch.equal(packed, per_sequence(layer, x, cu))

    remove_packed_gdn(model)
    with pytest.raises(ValueError) as info:  # Megatron's own check, no longer ours
        layer(x, None, packed_seq_params=packed_params(mc, torch.tensor([0, 32, 48], dtype=torch.int32)))
    assert not isinstance(info.value, InvalidPackedBoundaries)


def test_service_without_gdn_layers_does_nothing(mc) -> None:
    report = apply_packed_gdn(torch.nn.Linear(2, 2))
    assert report.mode == "none" and report.layers == ()
    assert not gdn_adapter.is_gdn_patched(mc.GatedDeltaNet)


def test_bootstrap_step_reads_the_kernel_choice(mc) -> None:
    layer = mc.build(seed=0)
    report = bootstrap.bootstrap({"actor": {"megatron": {"gdn_kernels": "auto"}}}).trainer_side.packed_gdn(torch.nn.Sequential(layer))
    assert report.mode == "native"
    gdn_adapter.remove_packed_validation(layer)
    with pytest.raises(ConfigError, match=r"actor\.megatron\.gdn_kernels"):
        bootstrap.bootstrap({"actor": {"megatron": {"gdn_kernels": "triton"}}}).trainer_side.packed_gdn(torch.nn.Sequential(layer))


def test_the_composition_root_makes_a_megatron_models_gdn_layers_packed_safe(mc, monkeypatch) -> None:
    from adapters.megatron import trainer_model
    from app import bootstrap

    built = []
    monkeypatch.setattr(
        trainer_model.MegatronTrainerModel, "build",
        classmethod(lambda cls, model, mode, chunk_size=None: built.append(model) or _Stub()),
    )
    model = torch.nn.Sequential(mc.build())
    bootstrap.bootstrap({"actor": {"fused_forward": "auto"}}, environ={}).trainer_side.logprob_service(model)
    assert built == [model]
    layer = model[0]
    assert getattr(layer, gdn_adapter._VALIDATION_HANDLE, None) is not None  # native 0.19.2: validated
    with pytest.raises(ValueError, match="gdn_kernels"):
        bootstrap.bootstrap({"actor": {"fused_forward": "auto", "megatron": {"gdn_kernels": "bogus"}}},
                            environ={}).trainer_side.logprob_service(model)


class _Stub:
    mode = types.SimpleNamespace(value="hook")


def test_thd_built_batches_run_megatron_gdn_layers_without_a_host_read(mc, upstream_on_cpu, monkeypatch) -> None:
    """Boundaries validated where adapters.megatron.thd builds the PackedSeqParams; every GDN layer
    then runs on boundary tensors that raise on any host read (tests/unit/test_gdn_packing)."""
    from adapters.megatron import gdn_forward, thd
    from domain.forward.thd import ThdLayout
    from tests.unit.test_gdn_packing import NoHostSync

    class ArmedNoHostSync(NoHostSync):
        """NoHostSync once armed: Megatron's own PackedSeqParams.__post_init__ may read (it
        builds its seq_idx), so reads raise only after the batch is built."""

        armed = False

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if not ArmedNoHostSync.armed:
                return super(NoHostSync, cls).__torch_function__(func, types, args, kwargs or {})
            return super().__torch_function__(func, types, args, kwargs)

    real = ThdLayout.cu_seqlens_tensor
    monkeypatch.setattr(ThdLayout, "cu_seqlens_tensor", lambda self, *, padded, device="cpu":
                        real(self, padded=padded, device=device).as_subclass(ArmedNoHostSync))
    real_validate = gdn_forward.validate_packed_seq_params

    def armed_validate(*args, **kwargs):  # type: ignore[no-untyped-def]
        ArmedNoHostSync.armed = True  # the builder's validation uses the layout's ints: no read
        try:
            return real_validate(*args, **kwargs)
        finally:
            ArmedNoHostSync.armed = False

    monkeypatch.setattr(gdn_forward, "validate_packed_seq_params", armed_validate)
    layout = ThdLayout.plan([20, 45, 7], align=ALIGN)
    batch = thd.packed_seq_params(layout)
    ArmedNoHostSync.armed = True
    plain = packed_params(mc, real(layout, padded=False), real(layout, padded=True))
    layers = [upstream_on_cpu(mc.build(seed=s)) for s in (1, 2)]
    x = torch.randn(layout.total, 1, HIDDEN)
    try:
        assert getattr(batch, gdn_forward.BOUNDARIES_ATTR).values == layout.cu_seqlens_padded
        for layer in layers:  # natively packed-aware Megatron-Core: our validation hook reads nothing
            gdn_adapter._validation_hook(layer, (x, None), {"packed_seq_params": batch})
        gdn_adapter.patch_gdn_forward(mc.GatedDeltaNet, kernels="reference", force=True)
        h = x
        for layer in layers:  # the packed-aware forward, layer after layer
            h, _ = layer(h, None, packed_seq_params=batch)
    finally:
        ArmedNoHostSync.armed = False
    expected = x
    for layer in layers:
        expected, _ = layer(expected, None, packed_seq_params=plain)
    assert torch.equal(h.as_subclass(torch.Tensor), expected)
