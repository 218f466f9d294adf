"""`refit demo qat` (app.services.qat_demo): QAT closes the train-rollout gap on the embedded model.

With QAT the training forward computes, bit for bit, what the quantized rollout engine computes,
so their k3 KL is exactly the BF16 level; the same training without QAT leaves a gap.
"""

from __future__ import annotations

import math

from app.cli.demo_qat import qat_demo_services
from app.services.qat_demo import run_qat_demo, synthetic_batch


def test_qat_arm_matches_the_quantized_rollout_and_bf16_arm_does_not() -> None:
    services = qat_demo_services("NVFP4", "micro-moe", 0)
    result = run_qat_demo(services, mode="NVFP4", model="micro-moe", steps=1, batch=2, seq_len=16, prompt_len=4)
    records = {(r["step"], r["arm"]): r for r in result["records"]}
    assert set(records) == {(0, "bf16"), (0, "qat"), (1, "bf16"), (1, "qat")}
    for step in (0, 1):
        assert records[(step, "qat")]["k3_quantized"] == 0.0
        assert records[(step, "bf16")]["k3_quantized"] > 0.0
        assert records[(step, "bf16")]["k3_bf16"] == 0.0
    assert all(math.isfinite(records[(1, arm)]["train_loss"]) for arm in ("bf16", "qat"))
    assert result["final"]["k3_quantized_with_qat"] < result["final"]["k3_quantized_without_qat"]
    assert result["qat_layers"] > 0


def test_synthetic_task_follows_the_permutation() -> None:
    import torch

    perm = torch.randperm(50, generator=torch.Generator().manual_seed(0))
    ids = synthetic_batch(perm, 3, 10, seed=1)
    assert torch.equal(ids[:, 1:], perm[ids[:, :-1]])
