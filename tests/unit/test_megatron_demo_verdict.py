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
