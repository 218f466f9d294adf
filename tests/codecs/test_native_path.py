"""The native codec kernels (adapters/native_codecs/) give the bytes of the eager reference.

Built once for the module (the first build on a machine takes about a minute; torch's extension
cache keeps it), and once more without AVX2, for the scalar code. Three levels, as tests/codecs/test_fast_path.py checks the compiled path: the
element encoders on every float32 whose low 16 bits are one of six patterns (every rounding
midpoint of E4M3 and E2M1, and its neighbours, both signs); every format under both element rules
(and both MX scale rules) on the adversarial blocks, a random weight whose rows and columns end in
partial blocks, and experts; and the codec path around them: calls the kernels do not port take
the compiled path, a non-finite weight is refused by name, and a refit chooses the native path
where it is bit-identical and faster.
"""

from __future__ import annotations

import pytest
import torch

from adapters.native_codecs import kernels as native
from domain.errors import NonFiniteTensor
from domain.quant.codecs import compile as kernels
from domain.quant.codecs import elements, quantize_weight
from domain.quant.formats import FP8_BLOCK, MXFP4, MXFP8, NVFP4, ElementRule, MxScaleRule
from tests.codecs.matrix import exact_ties, tiny_blocks
from tests.codecs.special import signed_zeros_and_decades, special_weight

_LOW_BITS = (0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF)


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    why = native.install()
    if why is not None:
        pytest.skip(f"the native kernels need a C++ compiler, and did not build here: {why}")


def _every_midpoint() -> torch.Tensor:
    high = torch.arange(0, 2**16, dtype=torch.int64) << 16
    bits = (high[:, None] | torch.tensor(_LOW_BITS)[None, :]).reshape(-1)
    values = (bits - (bits >= 2**31) * 2**32).to(torch.int32).view(torch.float32)
    return values[torch.isfinite(values)].contiguous()


def test_the_element_encoders_equal_the_reference_on_every_midpoint() -> None:
    x = _every_midpoint()
    assert torch.equal(native.encoders().e4m3_bytes(x), elements.to_e4m3(x).view(torch.uint8))
    fp4 = torch.cat([x.clamp(-6.0, 6.0), torch.tensor([0.0, -0.0, -1e-30, 1e-30])]).contiguous()
    for signed_zero in (True, False):
        assert torch.equal(native.encoders().e2m1_codes(fp4, signed_zero),
                           elements.e2m1_codes(fp4, signed_zero=signed_zero))


def _weights(fmt) -> dict[str, torch.Tensor]:
    k = {FP8_BLOCK.name: 1000, NVFP4.name: 1008}.get(fmt.name, 992)  # partial blocks; NVFP4: an odd block count
    mixed = torch.cat([special_weight(32, 256, torch.float32, block=16, seed=1), tiny_blocks(32, 256, 2),
                       signed_zeros_and_decades(64, 256, seed=3)])
    gen = torch.Generator().manual_seed(5)
    return {"ties": exact_ties(fmt, 128, 256, 4), "mixed": mixed.to(torch.bfloat16),
            "random": (torch.randn(300, k, generator=gen) * 3).to(torch.bfloat16),
            "experts": (torch.randn(3, 200, 256, generator=gen) * torch.logspace(-5, 4, 256)).to(torch.bfloat16)}


def _cases():
    for fmt in (FP8_BLOCK, MXFP8, MXFP4, NVFP4):
        for rule in ElementRule:
            for scale_rule in (list(MxScaleRule) if fmt in (MXFP8, MXFP4) else [None]):
                yield pytest.param(fmt, rule, scale_rule, id=f"{fmt.name}-{rule.value}-{scale_rule and scale_rule.value}")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


@pytest.mark.parametrize(("fmt", "rule", "scale_rule"), list(_cases()))
def test_every_format_and_rule_gives_the_eager_bytes(fmt, rule, scale_rule, monkeypatch) -> None:
    monkeypatch.setattr(kernels, "_compiled", _refused)  # every call here is the native kernels'
    options = {"numerics": rule} if scale_rule is None else {"numerics": rule, "scale_rule": scale_rule}
    for name, w in _weights(fmt).items():
        with kernels.use(kernels.CodecPath.EAGER):
            ref = quantize_weight(fmt, w, **options).tensors
        with kernels.use(kernels.CodecPath.NATIVE):
            got = quantize_weight(fmt, w, **options).tensors
        assert set(got) == set(ref)
        for key in ref:
            assert _same(got[key], ref[key]), f"{name}: {key}"


def test_the_scalar_build_gives_the_same_bytes(monkeypatch) -> None:
    """The code a CPU without AVX2 runs (and every build runs for a row's tail), built on its own."""
    scalar = native.module(avx2=False)
    assert not scalar.vectorized()
    x = _every_midpoint()
    assert torch.equal(scalar.e4m3_bytes(x), elements.to_e4m3(x).view(torch.uint8))
    monkeypatch.setattr(native, "module", lambda: scalar)
    monkeypatch.setattr(kernels, "_compiled", _refused)
    for fmt in (FP8_BLOCK, MXFP8, MXFP4, NVFP4):
        for rule in ElementRule:
            for name in ("mixed", "random", "experts"):
                w = _weights(fmt)[name]
                with kernels.use(kernels.CodecPath.EAGER):
                    ref = quantize_weight(fmt, w, numerics=rule).tensors
                with kernels.use(kernels.CodecPath.NATIVE):
                    got = quantize_weight(fmt, w, numerics=rule).tensors
                assert all(_same(got[key], ref[key]) for key in ref), f"{fmt.name} {rule.value} {name}"


def _refused(fn):
    raise AssertionError(f"{fn.__qualname__} took the compiled path")


def _uncompiled(fn):
    return fn  # the compiled path's kernel (fast encoders), run eagerly


def test_calls_the_kernels_do_not_port_take_the_compiled_path(monkeypatch) -> None:
    monkeypatch.setattr(kernels, "_compiled", _uncompiled)
    w = (torch.randn(256, 512, generator=torch.Generator().manual_seed(2)) * 2).float()  # float32: not ported
    for fmt in (FP8_BLOCK, MXFP8, MXFP4, NVFP4):
        assert native._fp8_block(w, (128, 128), ElementRule.ENGINE, False) is None
        with kernels.use(kernels.CodecPath.EAGER):
            ref = quantize_weight(fmt, w).tensors
        with kernels.use(kernels.CodecPath.NATIVE):
            got = quantize_weight(fmt, w).tensors
        assert all(_same(got[key], ref[key]) for key in ref), fmt.name
    assert set(kernels.native_kernels()) == {"domain.quant.codecs.fp8_block._quantize_kernel",
                                             "domain.quant.codecs.mx._quantize_kernel",
                                             "domain.quant.codecs.nvfp4._quantize_kernel",
                                             "domain.quant.codecs.nvfp4._amax_kernel"}


@pytest.mark.parametrize("fmt", [FP8_BLOCK, MXFP8, MXFP4, NVFP4], ids=lambda f: f.name)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_weight_is_refused_by_name(fmt, bad, monkeypatch) -> None:
    monkeypatch.setattr(kernels, "_compiled", _refused)
    w = torch.randn(128, 256).to(torch.bfloat16)
    w[7, 100] = bad
    with kernels.use(kernels.CodecPath.NATIVE), pytest.raises(NonFiniteTensor, match=r"layers\.0\.w"):
        quantize_weight(fmt, w, name="layers.0.w")


def test_a_refit_chooses_the_native_path_and_says_so(monkeypatch) -> None:
    from adapters.reference.config import MICRO_MOE
    from adapters.reference.engine import ReferenceEngine
    from app.services import codec_path
    from app.services.refit import RefitService
    from domain.quant.plan import QuantizationPlan
    from tests import refit_support as rs

    monkeypatch.setattr(kernels, "_compiled", _refused)  # the native kernels take every call here
    plan = QuantizationPlan.from_presets("FP8_BLOCK", "MXFP8")
    tried = codec_path._try(plan, rs.trainer(), kernels.CodecPath.NATIVE)  # warm-up, then every tensor compared
    assert "the native path is bit-identical to eager on every tensor of the model" in tried.reason
    assert tried.eager_seconds > 0 and tried.compiled_seconds > 0
    assert tried.path is kernels.CodecPath.NATIVE or tried.reason.endswith("not faster")  # which is faster: the machine's

    # the refit's own choice, with the comparison's verdict fixed (faster, same bytes), so that the
    # refit quantizes natively whatever the load: its report says so, and the engine holds the eager bytes
    monkeypatch.setattr(codec_path, "AUTO_MIN_BYTES", 0)
    monkeypatch.setattr(codec_path, "_compare", lambda plan, trainer, fast: (None, 1.0, 0.5))
    weights, paths = {}, {}
    for policy in ("auto", "eager"):
        engine = ReferenceEngine(MICRO_MOE, plan)
        svc = RefitService(rs.trainer(), engine, plan, bucket_bytes=rs.SMALL_BUCKET, codec_path=policy,
                           native_codecs=native.install)
        paths[policy] = svc.refit().codec_path
        weights[policy] = rs.bits(engine.live_weights())
    assert paths == {"auto": "native", "eager": "eager"}
    assert rs.same_bits(weights["auto"], weights["eager"])


def test_a_native_build_that_fails_leaves_the_compiled_path(monkeypatch) -> None:
    from app.services import codec_path
    from domain.quant.plan import QuantizationPlan
    from tests import refit_support as rs

    monkeypatch.setattr(kernels, "_compiled", _uncompiled)
    choice = codec_path.choose_codec_path(QuantizationPlan.from_presets("MXFP4", "MXFP4"), rs.trainer(), min_bytes=0,
                                          native=lambda: "the native codecs did not build (no compiler)")
    assert choice.reason.startswith("the native codecs did not build (no compiler); the compiled path is")
    assert choice.path in (kernels.CodecPath.COMPILED, kernels.CodecPath.EAGER)
