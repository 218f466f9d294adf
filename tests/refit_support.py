"""Helpers shared by the refit tests: the micro model, its streams, bucket lists, bit snapshots."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import torch

from adapters.reference.config import MICRO_MOE, ReferenceModelConfig
from adapters.reference.trainer import ReferenceTrainer
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import quantize_stream
from domain.refit.buckets import Bucket, pack_buckets

DEFAULT_PLAN = QuantizationPlan.from_presets(linear="FP8_BLOCK", moe="NVFP4")
if TYPE_CHECKING:
    from adapters.distributed.shm_transport import ShmTransport

SMALL_BUCKET = 64 << 10  # 64 KiB: the micro model's refit takes several buckets


def trainer(seed: int = 0, cfg: ReferenceModelConfig = MICRO_MOE) -> ReferenceTrainer:
    return ReferenceTrainer.from_seed(cfg, seed)


def stream(t: ReferenceTrainer, plan: QuantizationPlan = DEFAULT_PLAN) -> list[tuple[str, torch.Tensor]]:
    return list(quantize_stream(plan, t.named_weights()))


def buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int = SMALL_BUCKET, **kw: object) -> list[Bucket]:
    return list(pack_buckets(named, bucket_bytes, **kw))  # type: ignore[arg-type]


def bits(weights: object) -> dict[str, torch.Tensor]:
    """A bit-exact snapshot of a mapping of tensors (compare with `same_bits`)."""
    return {n: t.detach().reshape(-1).view(torch.uint8).clone() for n, t in weights.items()}  # type: ignore[attr-defined]


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def full_refit(engine: object, bucket_list: list[Bucket], refit_id: int = 1) -> object:
    engine.begin_refit(refit_id)  # type: ignore[attr-defined]
    for b in bucket_list:
        engine.load_bucket(b)  # type: ignore[attr-defined]
    return engine.finalize_refit()  # type: ignore[attr-defined]


def token_ids(cfg: ReferenceModelConfig = MICRO_MOE, batch: int = 2, seq: int = 24, seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)


@pytest.fixture(autouse=True)
def one_thread():
    """Refit tests run many small operators: on a shared machine, more than one intra-op thread
    makes each of them wait on descheduled workers. Imported by the refit test modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def shm_pair(receivers: int = 1, *, bucket_bytes: int = 64 << 20,
             **serve: Any) -> tuple[ShmTransport, list[ShmTransport]]:
    """A shared-memory ring's source and its receivers, all in this process: serve, connect,
    accept. `serve`: ShmSource.serve's keywords (slots, slot_bytes, timeout_s)."""
    from adapters.distributed.shm_transport import ShmSource, connect

    source = ShmSource.serve(receivers, **serve)
    ends = [connect(source.rendezvous, r, bucket_bytes) for r in range(1, receivers + 1)]
    return source.accept(), ends
