"""Megatron-Core trainer models for the composition root: one rank's full model (the log-prob
forward and the refit's source), its sharded view, packed GatedDeltaNet input made safe.

The model arrives as the caller built it (a GPTModel, wrappers allowed, or a list of virtual
pipeline chunks for the GDN patch); the adapters below check what they need of it.
"""

from __future__ import annotations

from typing import cast

import torch

from adapters.megatron.packed_gdn import PackedGdnReport, apply_packed_gdn
from adapters.megatron.sharded_model import MegatronShardedModel
from adapters.megatron.trainer_model import MegatronTrainerModel
from domain.forward.mode import FusedForwardMode
from domain.refit.topology import ParallelLayout


def packed_gdn(model: object, kernels: str) -> PackedGdnReport:
    """Let the model's GatedDeltaNet layers take packed (THD) input safely (a no-op without them).

    Args:
        model: the built model (or its chunks).
        kernels: actor.megatron.gdn_kernels.
    """
    return apply_packed_gdn(cast(torch.nn.Module, model), kernels=kernels)


def megatron_trainer(model: object, mode: FusedForwardMode, *, gdn_kernels: str,
                     chunk_size: int | None = None) -> MegatronTrainerModel:
    """The TrainerModel over a built Megatron model: packed GDN made safe, then the fused-forward
    mode decided once (hook, legacy) and stored on the model.

    Args:
        model: the built Megatron model (wrappers allowed).
        mode: the requested fused-forward mode.
        gdn_kernels: actor.megatron.gdn_kernels.
        chunk_size: tokens per chunk of the fused computation (None: sized from the vocabulary).
    """
    packed_gdn(model, gdn_kernels)
    return MegatronTrainerModel.build(cast(torch.nn.Module, model), mode, chunk_size=chunk_size)


def megatron_sharded(model: object, layout: ParallelLayout, rank: int) -> MegatronShardedModel:
    """This trainer rank's ShardedTrainerModel. The rollout serves BF16 weights: float32 master
    weights are read as BF16, tensor by tensor."""
    return MegatronShardedModel.build(cast(torch.nn.Module, model), layout, rank, dtype=torch.bfloat16)
