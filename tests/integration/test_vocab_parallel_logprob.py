"""Vocabulary-parallel fused log-probs over 2 gloo processes equal the single-process result."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adapters.distributed.vocab_group import TorchVocabGroup
from domain.forward.fused_logprob import IGNORE_INDEX, fused_logprob_entropy
from tests.megatron_cpu import free_port

pytestmark = pytest.mark.distributed

WORLD = 2
T, H, V = 29, 16, 2 * 37
TIMEOUT_S = 90


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)  # identical on every rank
    h = torch.randn(T, H, generator=gen)
    w = torch.randn(V, H, generator=gen) * 0.5
    y = torch.randint(0, V, (T,), generator=gen)
    y[5] = IGNORE_INDEX
    y[0], y[1] = 0, V - 1  # one label on each shard's edge
    return h, w, y


def _loss(lp: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
    coef = torch.linspace(-1.0, 2.0, lp.numel())
    return (lp * coef).sum() + 0.5 * (ent * coef.flip(0)).sum()


def _worker(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        h, w, y = _inputs()
        # Single-process result on the full vocabulary.
        h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp1, ent1 = fused_logprob_entropy(h1, w1, y, temperature=0.8, chunk_size=8)
        gh1, gw1 = torch.autograd.grad(_loss(lp1, ent1), (h1, w1))
        # This rank's shard of the vocabulary.
        shard = V // WORLD
        hp = h.clone().requires_grad_()
        wp = w[rank * shard : (rank + 1) * shard].clone().requires_grad_()
        lp, ent = fused_logprob_entropy(
            hp, wp, y, temperature=0.8, chunk_size=8, vocab_group=TorchVocabGroup(dist.group.WORLD)
        )
        ghp, gwp = torch.autograd.grad(_loss(lp, ent), (hp, wp))
        torch.testing.assert_close(lp, lp1, rtol=0, atol=2e-6)
        torch.testing.assert_close(ent, ent1, rtol=0, atol=2e-6)
        torch.testing.assert_close(ghp, gh1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gwp, gw1[rank * shard : (rank + 1) * shard], rtol=1e-5, atol=1e-5)
        # Without the built-in reduction each rank holds its partial hidden gradient; their sum
        # is the full one (what Megatron's sequence-parallel reduce-scatter computes).
        hq = h.clone().requires_grad_()
        lp2, ent2 = fused_logprob_entropy(
            hq, wp.detach(), y, temperature=0.8, chunk_size=8,
            vocab_group=TorchVocabGroup(dist.group.WORLD), reduce_hidden_grad=False,
        )
        (partial,) = torch.autograd.grad(_loss(lp2, ent2), hq)
        assert not torch.allclose(partial, gh1, atol=1e-3)
        dist.all_reduce(partial)
        torch.testing.assert_close(partial, gh1, rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_match_single_process():
    ctx = mp.start_processes(_worker, args=(free_port(),), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=1.0):  # raises ProcessRaisedException if a rank failed
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            pytest.fail(f"vocab-parallel ranks did not finish within {TIMEOUT_S} s")
