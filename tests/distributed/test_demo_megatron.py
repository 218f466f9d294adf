"""`refit demo megatron`: a real Megatron-Core trainer sharded over gloo processes
trains and refits; the command judges every refit against the trainer's own weights gathered into
the unsharded model (placed by Megatron's own checkpoint metadata) and says so in its JSON: the
engine holds exactly the unsharded refit, the BF16 arm's log-probs equal the reference engine's
forward on those weights, and Megatron's own forward stays within the documented bound."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core", reason="needs megatron-core (the `megatron` extra)")

from app.cli.main import main
from app.services.megatron_demo import MEGATRON_K3_BOUND

pytestmark = [pytest.mark.distributed, pytest.mark.megatron]


def _demo(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    rc = main(["demo", "megatron", "--json", *args])
    return rc, json.loads(capsys.readouterr().out)


def test_tp2_pp2_refits_every_step_exactly(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _demo(capsys, "--tp", "2", "--pp", "2")
    assert rc == 0
    assert out["world"] == {"layout": "tp=2 pp=2 ep=1", "trainer_ranks": 4, "engines": 1}
    refits = out["refits"]
    assert [(r["step"], r["arm"]) for r in refits][:2] == [(0, "linear=FP8_BLOCK moe=NVFP4"), (0, "BF16")]
    assert len(refits) == 2 * 4  # steps 0..3, two arms
    for r in refits:
        assert r["outcome"] == "live" and r["sharded_equals_unsharded"] is True and not r["errors"]
        if r["arm"] == "BF16":
            assert r["k3_kl"] == 0.0 and r["mean_abs_logp_diff"] == 0.0
        else:
            assert r["k3_kl"] > 0.0  # quantized weights do move the rollout's log-probs
        assert r["megatron_k3_kl"] > 0  # Megatron's own forward: the same model, another implementation
        if r["arm"] == "BF16":
            assert r["megatron_k3_kl"] <= MEGATRON_K3_BOUND
    losses = [r["loss"] for r in refits if r["arm"] == "BF16" and r["step"]]
    assert losses == sorted(losses, reverse=True) and losses[0] > losses[-1]  # it trains
    assert out["every_refit_live"] and out["sharded_equals_unsharded"] and out["bf16_k3_kl_exactly_zero"]
    assert out["megatron_k3_kl_within_bound"] and out["megatron_k3_kl_bound"] == MEGATRON_K3_BOUND
    assert out["megatron_k3_kl_max"] == max(r["megatron_k3_kl"] for r in refits if r["arm"] == "BF16")


# Every layout of q/k/v with two query groups on a rank (tp = 1) reads q/k/v through tensors
# derived from linear_qkv, not views: one training step is what tells a stale read apart.
SHAPES = {
    "tp1": ([], "tp=1 pp=1 ep=1", 1),
    "ep2": (["--ep", "2"], "tp=1 pp=1 ep=2", 2),
    "etp2": (["--etp", "2"], "tp=1 pp=1 ep=1 etp=2", 2),
    "ep2-etp2": (["--ep", "2", "--etp", "2"], "tp=1 pp=1 ep=2 etp=2", 4),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_shape_refits_the_trained_weights_exactly(shape: str, capsys: pytest.CaptureFixture[str]) -> None:
    args, layout, ranks = SHAPES[shape]
    model = ["--model", "micro-moe"] if ranks > 1 else []  # the default model at tp=1, the smallest elsewhere
    rc, out = _demo(capsys, *args, *model, "--steps", "1")
    assert out["world"] == {"layout": layout, "trainer_ranks": ranks, "engines": 1}
    assert [(r["step"], r["outcome"]) for r in out["refits"]] == [(0, "live")] * 2 + [(1, "live")] * 2
    assert all(r["sharded_equals_unsharded"] for r in out["refits"])
    assert [r["k3_kl"] for r in out["refits"] if r["arm"] == "BF16"] == [0.0, 0.0]
    assert 0 < out["megatron_k3_kl_max"] <= MEGATRON_K3_BOUND
    assert rc == 0


def test_expert_parallelism_carved_out_of_the_tensor_parallel_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _demo(capsys, "--tp", "2", "--ep", "2", "--model", "micro-moe", "--steps", "1", "--linear", "MXFP8",
                    "--moe", "MXFP4")
    assert rc == 0 and out["world"]["layout"] == "tp=2 pp=1 ep=2" and out["world"]["trainer_ranks"] == 2
    assert out["sharded_equals_unsharded"] and out["bf16_k3_kl_exactly_zero"] and out["megatron_k3_kl_within_bound"]


def test_a_layout_beyond_this_machine_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "megatron", "--tp", "2", "--pp", "2", "--ep", "2", "--etp", "2"]) == 2
    assert "needs 8 trainer processes" in capsys.readouterr().err
    assert main(["demo", "--tp", "2"]) == 2  # the embedded trainer is not sharded by --tp
    assert "--tp: is not an option of `refit demo`; it is an option of `refit demo megatron`" in capsys.readouterr().err
