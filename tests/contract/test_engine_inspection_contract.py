"""Contract of the EngineInspection port, run against the reference engine, the vLLM adapter over
its in-process workers (LocalWorkers) and over rl-refit's worker extension through the worker
protocol (ExtensionWorkers over fake vLLM workers): digests say "the same weights" bit for bit,
KV scales are four floats per attention layer, greedy refuses as serving does and is deterministic."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from adapters.reference.config import MICRO_MOE
from adapters.reference.engine import ReferenceEngine
from app.services.refit import RefitService
from domain.errors import EngineStale
from ports.engine_inspection import EngineInspection
from tests import refit_support as rs
from tests.refit_support import one_thread  # noqa: F401  (autouse fixture)

KINDS = ("reference", "vllm-local", "vllm-extension")


def _refits_micro_moe(engine: Any) -> tuple[Any, Callable[[int], None], int]:
    """The engine, a refit of the embedded trainer perturbed by `seed` (0: as seeded), the vocabulary."""
    def refit(seed: int) -> None:
        t = rs.trainer()
        if seed:
            t.perturb_(seed=seed, scale=0.05)
        rs.full_refit(engine, rs.buckets(rs.stream(t)), refit_id=seed + 1)

    return engine, refit, MICRO_MOE.vocab_size


def _reference() -> tuple[Any, Callable[[int], None], int]:
    return _refits_micro_moe(ReferenceEngine(MICRO_MOE, rs.DEFAULT_PLAN))


def _vllm_local() -> tuple[Any, Callable[[int], None], int]:
    from tests.engine_fakes import stream_engine

    return _refits_micro_moe(stream_engine("vllm", MICRO_MOE.vocab_size))


def _vllm_extension() -> tuple[Any, Callable[[int], None], int]:
    from tests.engine_fakes.vllm import VOCAB, FakeTrainer, extension_engine, fp8_plan

    _, _, engine = extension_engine()

    def refit(seed: int) -> None:
        assert RefitService(FakeTrainer(seed), engine, fp8_plan(), bucket_bytes=1 << 16).refit().ok

    return engine, refit, VOCAB


@pytest.fixture(params=KINDS)
def inspected(request):  # type: ignore[no-untyped-def]
    return {"reference": _reference, "vllm-local": _vllm_local, "vllm-extension": _vllm_extension}[request.param]()


def test_the_engine_serves_the_port(inspected) -> None:  # type: ignore[no-untyped-def]
    engine, _, _ = inspected
    assert isinstance(engine, EngineInspection)


def test_digests_are_the_same_for_the_same_weights_and_differ_for_others(inspected) -> None:  # type: ignore[no-untyped-def]
    engine, refit, _ = inspected
    refit(0)
    first = engine.digests()
    assert first and set(first) == set(engine.live_weights())  # every parameter and buffer
    assert all(len(d) == 64 and int(d, 16) >= 0 for d in first.values())
    refit(1)
    other = engine.digests()
    assert other.keys() == first.keys() and other != first
    refit(0)
    assert engine.digests() == first  # back to the same weights: the same digests, bit for bit


def test_kv_scales_are_four_floats_per_attention_layer(inspected) -> None:  # type: ignore[no-untyped-def]
    engine, refit, _ = inspected
    refit(0)
    scales = engine.kv_scales()
    assert all(len(v) == 4 and all(isinstance(x, float) for x in v) for v in scales.values())
    if not isinstance(engine, ReferenceEngine) and not scales:
        return  # a model without attention layers (the stream-shaped fake) has none
    assert scales and all(v == [1.0, 1.0, 1.0, 1.0] for v in scales.values())  # reset by the refit


def test_greedy_refuses_while_stale_then_serves_tokens_of_the_vocabulary(inspected) -> None:  # type: ignore[no-untyped-def]
    engine, refit, vocab = inspected
    with pytest.raises(EngineStale):
        engine.greedy([[1, 2, 3]], 2)
    refit(0)
    tokens = engine.greedy([[1, 2, 3], [4, 5, 6]], 3)
    assert len(tokens) == 2 and all(len(t) == 3 and all(0 <= x < vocab for x in t) for t in tokens)
    assert engine.greedy([[1, 2, 3], [4, 5, 6]], 3) == tokens  # greedy is deterministic
