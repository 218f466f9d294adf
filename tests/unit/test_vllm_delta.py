"""Delta refits through the vLLM adapter (fake vLLM model and hooks): the worker's receiver patches
records into whole tensors before vLLM's layerwise reload, so the model's bytes equal a full
refit's; the expected-layout check accepts records; a failed refit drops the worker's copy."""

from __future__ import annotations

import pytest
import torch

from adapters.reference.trainer import AdamLikeSteps
from adapters.vllm.delta import base_from_plain, base_to_plain
from adapters.vllm.engine import VllmRolloutEngine
from app.services.refit import RefitService
from domain.errors import RefitFailed
from domain.refit.delta_sync import DeltaBase, DeltaSender
from domain.refit.engine_layout import layout_of
from domain.refit.report import RefitOutcome
from tests.engine_fakes.vllm import FakeLayerwise, FakeVllmModel, fake_hooks, fp8_plan, trainer_weights

SMALL_BUCKET = 40_000


class _Trainer:
    """The fake vLLM model's trainer weights, held so that an optimizer can step them."""

    def __init__(self) -> None:
        self.weights = dict(trainer_weights(0, False))

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.weights.items())

    def log_probs(self, input_ids, *, temperature=1.0):  # type: ignore[no-untyped-def]
        raise NotImplementedError


def _engine() -> tuple[FakeVllmModel, VllmRolloutEngine]:
    model = FakeVllmModel(quantized=True)
    return model, VllmRolloutEngine.in_process(model, None, fake_hooks(FakeLayerwise()))


def _bytes(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().reshape(-1).view(torch.uint8).clone() for n, t in m.state_dict().items()}


def test_vllm_delta_refits_give_the_bytes_of_full_refits():
    trainer = _Trainer()
    adam = AdamLikeSteps.of(trainer.weights.values())
    dm, delta_engine = _engine()
    fm, full_engine = _engine()
    stream = list(trainer.named_weights())
    from domain.quant.stream import quantize_stream

    delta_engine.expected_layout = layout_of(quantize_stream(fp8_plan(), stream))  # records pass the check
    delta = RefitService(trainer, delta_engine, fp8_plan(), bucket_bytes=SMALL_BUCKET, delta=DeltaSender())
    full = RefitService(trainer, full_engine, fp8_plan(), bucket_bytes=SMALL_BUCKET)
    modes = []
    for step in range(3):
        if step:
            adam.step_(seed=step, lr=1e-4)
        modes.append(delta.refit().delta.mode)
        full.refit()
        a, b = _bytes(dm), _bytes(fm)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), f"step {step}"
    assert modes == ["full", "delta", "delta"]
    last = delta.reports[-1].delta
    assert last.tensors_delta > 0 and last.wire_bytes < last.full_bytes
    assert last.engine_host_bytes == last.trainer_host_bytes > 0


def test_a_failed_vllm_refit_drops_the_workers_copy_and_the_next_is_full():
    trainer = _Trainer()
    adam = AdamLikeSteps.of(trainer.weights.values())
    model, engine = _engine()
    delta = RefitService(trainer, engine, fp8_plan(), bucket_bytes=SMALL_BUCKET, delta=DeltaSender())
    delta.refit()
    adam.step_(seed=1, lr=1e-4)
    model.fail_at_call = model.load_calls
    with pytest.raises(RefitFailed) as failed:
        delta.refit()
    assert failed.value.report.outcome is RefitOutcome.STALE  # vLLM cannot roll back: stale, never mixed
    assert engine.delta_base().digest is None
    model.fail_at_call = None
    report = delta.refit()
    assert report.ok and report.delta.mode == "full" and "previous refit failed" in report.delta.why_full


def test_workers_that_disagree_read_as_no_base():
    same = base_to_plain(DeltaBase("ab", 10, 0.5))
    assert base_from_plain([same, same]) == DeltaBase("ab", 20, 0.5)
    assert base_from_plain([same, base_to_plain(DeltaBase("cd", 10, 0.7))]) == DeltaBase(None, 20, 0.7)
    assert base_from_plain([same, base_to_plain(DeltaBase())]).digest is None
