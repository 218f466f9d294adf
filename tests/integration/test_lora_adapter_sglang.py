"""The adapter LoRA mode into SGLang, against the in-process fake of SGLang's Engine (no SGLang
build runs here; the names and parameters used are checked against the pinned release by
tests/integration/test_engine_conformance.py): each version of the adapter is loaded under a name
of its own with `load_lora_adapter_from_tensors`, served (`lora_path`) only once it loaded, the
radix cache flushed and the previous name unloaded; a failed load keeps the previous one."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from adapters.reference.lora import LoraTrainer
from adapters.sglang.engine import SglangRolloutEngine, lora_name
from app.services.lora_sync import LoraSyncService
from app.services.refit import RefitService
from domain.errors import AdapterUpdateFailed
from domain.lora import WIRE_BUDGET_FACTOR
from domain.quant.plan import QuantizationPlan
from domain.refit.engine_layout import layout_of
from tests import refit_support as rs
from tests.engine_fakes.sglang import FakeSglangEngine, StreamSglangModel
from tests.refit_support import one_thread  # noqa: F401  (autouse fixture)


class Recording:
    """A log-prob function that records the adapter each request named."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.lora_paths: list[str | None] = []

    def __call__(self, input_ids: torch.Tensor, temperature: float = 1.0,
                 lora_path: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self.lora_paths.append(lora_path)
        shape = (input_ids.shape[0], input_ids.shape[1] - 1)
        return torch.full(shape, -math.log(self.vocab)), torch.full(shape, math.log(self.vocab))


def _service() -> tuple[LoraSyncService, FakeSglangEngine, Recording]:
    trainer = LoraTrainer.from_seed(rs.trainer(), r=4)
    named = list(trainer.base.named_weights())
    fake = FakeSglangEngine(StreamSglangModel(named))
    served = Recording(trainer.config.vocab_size)
    engine = SglangRolloutEngine(fake, QuantizationPlan.bf16(), log_prob_fn=served, expected_layout=layout_of(named))
    base = RefitService(trainer.base, engine, QuantizationPlan.bf16(), bucket_bytes=rs.SMALL_BUCKET)
    return LoraSyncService(trainer, engine, base), fake, served


def _held(fake: FakeSglangEngine, name: str, trainer: Any) -> None:
    """SGLang holds, under `name`, the trainer's adapter in PEFT's names: equal, not shared."""
    expected = dict(trainer.adapter.named_tensors())
    assert set(fake.loras[name]) == set(expected)
    for n, t in fake.loras[name].items():
        assert torch.equal(t, expected[n]) and t.data_ptr() != expected[n].data_ptr()
    config = fake.lora_configs[name]
    assert (config["r"], config["lora_alpha"]) == (trainer.adapter.r, trainer.adapter.lora_alpha)


def test_each_update_loads_a_new_name_serves_it_then_unloads_the_previous_one():
    svc, fake, served = _service()
    for update in (1, 2, 3):
        if update > 1:
            svc.trainer.perturb_(update, 0.05)  # type: ignore[attr-defined]
        flushes = fake.flushes
        report = svc.sync()
        if update > 1:
            assert fake.flushes == flushes + 1  # the radix cache dropped at the switch
        assert report.live and report.adapter_id == update
        assert report.base is not None if update == 1 else report.base is None
        assert set(fake.loras) == {lora_name(update)}  # the previous name was unloaded
        _held(fake, lora_name(update), svc.trainer)
        assert report.bytes_sent <= WIRE_BUDGET_FACTOR * report.adapter_bytes
        svc.engine.log_probs(rs.token_ids())  # type: ignore[attr-defined]
        assert served.lora_paths[-1] == lora_name(update)


def test_a_load_sglang_refuses_keeps_the_previous_adapter_serving():
    svc, fake, served = _service()
    assert svc.sync().live
    fake.fail_next_lora_load = "LoRA rank 4 exceeds max_lora_rank"
    svc.trainer.perturb_(5, 0.05)  # type: ignore[attr-defined]
    report = svc.sync()
    assert not report.live and report.adapter_id == 1
    assert "max_lora_rank" in (report.error or "") and "adapter 1 still serves" in (report.error or "")
    assert set(fake.loras) == {lora_name(1)}
    svc.engine.log_probs(rs.token_ids())  # type: ignore[attr-defined]
    assert served.lora_paths[-1] == lora_name(1)
    assert svc.sync().live and set(fake.loras) == {lora_name(3)}


def test_an_sglang_client_without_lora_calls_is_refused_by_name():
    class NoLora:
        pass

    engine = SglangRolloutEngine.__new__(SglangRolloutEngine)
    object.__setattr__(engine, "client", NoLora())
    object.__setattr__(engine, "_lora", None)
    object.__setattr__(engine, "_next_lora", 1)
    adapter = LoraTrainer.from_seed(rs.trainer(), r=4).adapter
    with pytest.raises(AdapterUpdateFailed, match="enable_lora"):
        engine.stage_adapter(adapter)
