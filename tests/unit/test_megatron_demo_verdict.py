"""The checks of `refit demo megatron` over its rows (app.services.megatron_demo.verdict):
each one fails on the row that breaks it, the Megatron figure only beyond its documented bound."""

from __future__ import annotations

from typing import Any

import pytest

from app.services.megatron_demo import BF16, MEGATRON_K3_BOUND, verdict

PLAN = "linear=FP8_BLOCK moe=NVFP4"


def _rows(**bf16: Any) -> list[dict[str, Any]]:
    good = {"outcome": "live", "sharded_equals_unsharded": True, "k3_kl": 0.0, "megatron_k3_kl": 2e-4}
    return [{"step": 0, "arm": PLAN, **good, "k3_kl": 3e-4, "megatron_k3_kl": 5e-3},  # quantized: no bound
            {"step": 0, "arm": BF16, **good, **bf16}]


def test_every_check_holds_on_good_rows() -> None:
    assert all(verdict(_rows()).values())
    assert all(verdict(_rows(megatron_k3_kl=MEGATRON_K3_BOUND)).values())  # the bound itself is within it


@pytest.mark.parametrize(("bad", "check"), [
    ({"outcome": "rolled-back"}, "every_refit_live"),
    ({"sharded_equals_unsharded": False}, "sharded_equals_unsharded"),
    ({"k3_kl": 1e-12}, "bf16_k3_kl_exactly_zero"),
    ({"megatron_k3_kl": MEGATRON_K3_BOUND * 1.01}, "megatron_k3_kl_within_bound"),
])
def test_each_check_fails_on_its_own_row(bad: dict[str, Any], check: str) -> None:
    checks = verdict(_rows(**bad))
    assert [k for k, ok in checks.items() if not ok] == [check]


def test_a_bf16_row_without_log_probs_fails_both_figures() -> None:
    rows = _rows()
    del rows[1]["k3_kl"], rows[1]["megatron_k3_kl"]  # a failed refit scores nothing
    checks = verdict(rows)
    assert not checks["bf16_k3_kl_exactly_zero"] and not checks["megatron_k3_kl_within_bound"]


# --- on a real engine (`--engine vllm`): each step against a cold start of the unsharded export ---

def _arm(outcome: str = "live", **extra: Any) -> dict[str, Any]:
    return {"outcome": outcome, "error": None if outcome == "live" else "refit failed", "mb": 1.0, "ms": 5.0, **extra}


def _world_records(served_at: tuple[int, ...]) -> list[dict[str, Any]]:
    import pickle

    records = []
    for step in (0, 1):
        records.append({"step": step, "rank": 0, "role": "trainer", "loss": None if step == 0 else 6.0,
                        "arms": {PLAN: _arm()}})
        engine = _arm(served=pickle.dumps(f"served {step}"), report=f"report {step}") if step in served_at \
            else _arm("rolled-back")
        records.append({"step": step, "rank": 1, "role": "engine", "loss": None, "arms": {PLAN: engine}})
    return records


class _Comparer:
    """ColdStartComparer's `against`, recording what it was given; step 1's cold start differs
    when `differs` is set."""

    def __init__(self, differs: bool = False) -> None:
        self.differs, self.given = differs, []

    def against(self, seen: Any, trainer: Any, report: Any, step: int) -> Any:
        from types import SimpleNamespace

        self.given.append((seen, {n: float(t) for n, t in trainer.named_weights()}, report, step))
        equal = not (self.differs and step == 1)
        return SimpleNamespace(comparison=lambda: {"equals_cold_start": equal, "max_abs_logp_diff": 0.0 if equal else 0.5})


def _unsharded() -> dict[int, tuple[dict[str, bytes], bytes]]:
    import torch

    from app.services.megatron_demo import _pack

    return {step: ({"w": _pack(torch.tensor(float(step)))}, _pack(torch.zeros(1))) for step in (0, 1)}


def _settings() -> Any:
    from app.services.megatron_demo import MegatronDemoSettings
    from domain.quant.plan import QuantizationPlan

    return MegatronDemoSettings(QuantizationPlan.from_presets("FP8_BLOCK", "NVFP4"), PLAN, steps=1)


def test_each_step_is_compared_with_the_cold_start_of_its_own_unsharded_weights() -> None:
    from app.services.megatron_demo import cold_start_verdict, judge_cold_starts

    comparer = _Comparer()
    rows = judge_cold_starts(comparer, _settings(), _world_records(served_at=(0, 1)), _unsharded())  # type: ignore[arg-type]
    assert [(seen, weights, report, step) for seen, weights, report, step in comparer.given] == [
        ("served 0", {"w": 0.0}, "report 0", 0), ("served 1", {"w": 1.0}, "report 1", 1)]
    assert [(r["step"], r["outcome"], r["loss"], r["equals_cold_start"]) for r in rows] == [
        (0, "live", None, True), (1, "live", 6.0, True)]
    assert all(cold_start_verdict(rows).values())


def test_a_step_unequal_to_its_cold_start_or_not_live_fails_the_demo() -> None:
    from app.services.megatron_demo import cold_start_verdict, judge_cold_starts

    rows = judge_cold_starts(_Comparer(differs=True), _settings(), _world_records((0, 1)), _unsharded())  # type: ignore[arg-type]
    assert [r["equals_cold_start"] for r in rows] == [True, False] and rows[1]["max_abs_logp_diff"] == 0.5
    assert cold_start_verdict(rows) == {"every_refit_live": True, "equals_cold_start": False}
    rows = judge_cold_starts(_Comparer(), _settings(), _world_records((0,)), _unsharded())  # type: ignore[arg-type]
    assert rows[1]["outcome"] == "mixed" and rows[1]["equals_cold_start"] is False
    assert cold_start_verdict(rows) == {"every_refit_live": False, "equals_cold_start": False}
