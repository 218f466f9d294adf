"""The embedded engine on a GPU (the instrumented device, tests/fake_device.py): its live weights,
its staging and its forward live on its device, a refit keeps every captured pointer, and it serves
exactly what the same refit into a host engine serves."""

from __future__ import annotations

import pytest
import torch

from adapters.reference.config import MICRO_MOE
from adapters.reference.engine import ReferenceEngine
from app.services.refit import RefitService
from app.services.transaction import Ownership
from domain.refit.report import RefitOutcome
from tests import refit_support as rs
from tests.fake_device import FakeCuda, on_fake


@pytest.mark.parametrize("ownership", [Ownership.BY_REFERENCE, Ownership.REUSED])
def test_a_refit_into_the_engine_on_a_gpu_serves_what_the_host_engine_serves(ownership):
    trainer = rs.trainer()
    ids = rs.token_ids()
    host = ReferenceEngine(MICRO_MOE, rs.DEFAULT_PLAN)
    RefitService(trainer, host, rs.DEFAULT_PLAN, ownership=ownership).refit()
    expected = host.log_probs(ids)
    staged_on: list[bool] = []

    def staged_where(group, tensors) -> None:
        staged_on.extend(on_fake(t) for t in tensors.values())

    with FakeCuda(host_buffers="allow"):
        engine = ReferenceEngine(MICRO_MOE, rs.DEFAULT_PLAN, device="cuda", verifiers=[staged_where])
        before = engine.storage_fingerprint()
        report = RefitService(trainer, engine, rs.DEFAULT_PLAN, ownership=ownership).refit()
        live = dict(engine.live_weights())
        served = engine.log_probs(ids)
        same_bytes = all(torch.equal(live[n].view(torch.uint8).cpu() if live[n].dim() else live[n].cpu(),
                                     t.view(torch.uint8) if t.dim() else t)
                         for n, t in host.live_weights().items())
    assert report.outcome is RefitOutcome.LIVE and report.storage.ok
    assert engine.storage_fingerprint() == before
    assert all(on_fake(t) for t in live.values())
    assert staged_on and all(staged_on)
    assert same_bytes
    assert torch.equal(served[0], expected[0]) and torch.equal(served[1], expected[1])
    assert served[0].device.type == "cpu"  # log-probs come back on the host


def test_the_trainer_on_a_gpu_scores_where_its_weights_are():
    host = rs.trainer()
    ids = rs.token_ids()
    expected = host.log_probs(ids)
    with FakeCuda(host_buffers="allow"):
        on_gpu = type(host)(host.config, {k: v.to("cuda") for k, v in host.weights.items()})
        got = on_gpu.log_probs(ids)  # the batch on the host, the weights on the device
    assert got[0].device.type == "cpu"
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
