"""Distributed refits over gloo (4 processes on 127.0.0.1) against the single-process refit.

One world runs every layout in turn (tp=2, pp=2, ep=2, one trainer to three engines), two refits
each (step 0, then a training-like step 1): every engine's live weights must be bit-identical to
the single-process refit's, and the NVFP4 global scales of units split across TP ranks must equal
the codecs' own `nvfp4_global_scale` over the full tensors.
"""

from __future__ import annotations

import pytest
import torch

from adapters.distributed.launch import launch_world
from domain.quant import naming
from domain.quant.codecs import nvfp4_global_scale
from tests.distributed import support

pytestmark = pytest.mark.distributed

CASES = [
    ({"tp": 2}, 2, ("NVFP4", "NVFP4")),  # q/k/v and o_proj split across TP: amax all-reduce
    ({"tp": 2}, 2, ("FP8_BLOCK", "MXFP4")),  # k/v shards of 64 rows straddle 128-row blocks: gathered
    ({"pp": 2}, 2, ("FP8_BLOCK", "NVFP4")),  # two stages take turns
    ({"ep": 2}, 2, ("FP8_BLOCK", "NVFP4")),  # experts on two ranks, dense layers on one
    ({}, 3, (None, None)),  # BF16, one trainer broadcasting to three engines
]


@pytest.fixture(scope="module")
def world_results() -> list[support.Any]:
    results = launch_world(support.layouts_rank, 4, (CASES,), timeout_s=90)
    failed = [f"rank {r.rank}: {r.error}\n{r.traceback or ''}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    return [r.value for r in results]


@pytest.fixture(scope="module")
def references() -> dict[tuple[object, int], dict[str, str]]:
    presets = {c[2] for c in CASES}
    return {(pr, step): support.single_process_digest(support.plan(*pr), step) for pr in presets for step in (0, 1)}


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{c[0] or 'tp=1'}-{c[1]}eng-{c[2]}" for c in CASES])
def test_engines_bit_identical_to_single_process_refit(case: int, world_results: list, references: dict) -> None:
    _layout, engines, presets = CASES[case]
    trainers = 4 - engines
    records = [world_results[rank][case] for rank in range(4)]
    assert all(rec["outcomes"] == ["live", "live"] for rec in records)
    for rank in range(trainers, 4):
        for step in (0, 1):
            got, want = records[rank]["digests"][step], references[(presets, step)]
            assert got.keys() == want.keys()
            differ = [n for n in want if got[n] != want[n]]
            assert not differ, f"rank {rank}, step {step}: {differ[:5]} differ from the single-process refit"


def test_split_global_scales_equal_single_process(world_results: list) -> None:
    case = 0  # tp=2, NVFP4 everywhere
    scales0, scales1 = world_results[0][case]["scales"], world_results[1][case]["scales"]
    assert scales0 == scales1, "the two TP ranks disagree on their global scales"
    assert "model.layers.0.self_attn.qkv" in scales0 and "model.layers.0.self_attn.o_proj.weight" in scales0
    for step in (0, 1):
        full = dict(support.trainer_at(step).named_weights())
        for unit, values in scales0.items():
            if unit.rsplit(".", 1)[-1] in ("qkv", "gate_up"):
                members = [full[f"{m}.weight"] for m in naming.group_members(unit)]
            else:
                members = [full[unit]]
            want = nvfp4_global_scale(*members, name=unit)
            got = torch.tensor([values[step]], dtype=torch.float32)
            assert torch.equal(got, want), f"{unit}, step {step}: {got} != {want}"
