"""The embedded reference engine, built for the plan it is given."""

from __future__ import annotations

from collections.abc import Mapping

from adapters.reference.config import ReferenceModelConfig
from adapters.reference.engine import ReferenceEngine
from domain.quant.plan import QuantizationPlan
from domain.refit.session import CommitMode


def build_reference_engine(config: ReferenceModelConfig, plan: QuantizationPlan, *,
                           commit_mode: CommitMode | None = None,
                           kv_cache_scheme: Mapping[str, object] | None = None,
                           device: str = "cpu") -> ReferenceEngine:
    """A ReferenceEngine of the model's shapes, its live layout that of `plan`.

    Args:
        config: the embedded model's shapes (reference.model, or model.path's checkpoint).
        plan: the plan the refits into it send.
        commit_mode: rollout.commit_mode (None: transactional, the reference engine's own).
        kv_cache_scheme: the quantization config's kv_cache_scheme (None = uncalibrated).
        device: reference.device: where its weights live and its forward runs ("cpu", "cuda", "cuda:1").
    """
    return ReferenceEngine(config, plan, commit_mode=commit_mode or CommitMode.TRANSACTIONAL,
                           kv_cache_scheme=kv_cache_scheme, device=device)
