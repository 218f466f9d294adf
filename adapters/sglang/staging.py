"""What travels to SGLang's custom loader besides tensors: markers and the staging rule.

A refit is one SGLang weight-update session. The loader sees the session's tensors in calls of
`update_weights_from_tensor(..., load_format=LOADER)`; three marker tensors frame it:
BEGIN (carries the staging rule as JSON bytes), FINAL (rebuild now) and ABORT (restore now).
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import torch

from domain.quant.formats import MXFP4, MXFP8, NVFP4
from domain.quant.plan import QuantizationPlan

# The import path SGLang is given as `custom_weight_loader` and as `load_format`.
LOADER_PATH = "adapters.sglang.loader.load"
MARKER_PREFIX = "__rl_refit__."
BEGIN_MARKER = MARKER_PREFIX + "begin"
FINAL_MARKER = MARKER_PREFIX + "final"
ABORT_MARKER = MARKER_PREFIX + "abort"
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")
FP4_EXPERT_LOCALS = (".weight_packed", ".weight_scale", ".weight_global_scale", ".input_global_scale")


@attrs.frozen
class StagingRule:
    """Which refit tensors the loader holds back until the final marker.

    Attributes:
        mxfp8_scales: MXFP8 block scales (SGLang swizzles them together with their weight).
        fp4_experts: MXFP4/NVFP4 routed-expert tensors (their kernel layout is built over every
            expert of a layer at once).
        native_mxfp8: SGLang's native MXFP8 layout: block scales are read as `weight_scale_inv`.
    """

    mxfp8_scales: bool = False
    fp4_experts: bool = False
    native_mxfp8: bool = False

    @classmethod
    def for_plan(cls, plan: QuantizationPlan, *, native_mxfp8: bool = False) -> StagingRule:
        """The rule for a plan (native_mxfp8: the dispatch's `sglang-mxfp8` layout)."""
        return cls(
            mxfp8_scales=MXFP8.name in (plan.linear.name, plan.moe.name),
            fp4_experts=plan.moe.name in (MXFP4.name, NVFP4.name),
            native_mxfp8=native_mxfp8,
        )

    def must_stage(self, name: str) -> bool:
        """True when `name` waits for the final marker."""
        if self.mxfp8_scales and name.endswith(SCALE_SUFFIXES):
            return True
        return self.fp4_experts and ".experts." in name and name.endswith(FP4_EXPERT_LOCALS)

    def engine_name(self, name: str) -> str:
        """The name SGLang's loader expects (native MXFP8 reads `weight_scale_inv`)."""
        if self.native_mxfp8 and name.endswith(".weight_scale"):
            return name + "_inv"
        return name

    def to_tensor(self, refit_id: int) -> torch.Tensor:
        """The BEGIN marker's payload: this rule and the refit id as JSON bytes."""
        payload = json.dumps({"refit_id": refit_id, **attrs.asdict(self)}).encode()
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).clone()

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> tuple[int, StagingRule]:
        """Read a BEGIN marker's payload back: (refit id, rule)."""
        data = _payload(t)
        refit_id = int(data.pop("refit_id"))
        data.pop("status", None)
        return refit_id, cls(**data)


def _payload(t: torch.Tensor) -> dict[str, Any]:
    data = json.loads(bytes(t.detach().cpu().to(torch.uint8).tolist()).decode())
    if not isinstance(data, dict):
        raise ValueError("the BEGIN marker's payload is not a JSON object")
    return data


def with_status(t: torch.Tensor, path: str) -> torch.Tensor:
    """A BEGIN payload that also names the file where the loader reports each call's outcome
    instead of raising into SGLang's scheduler (an exception there stops the server): the
    attached deployment (adapters.sglang.http_client)."""
    payload = json.dumps({**_payload(t), "status": path}).encode()
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).clone()


def status_of(t: torch.Tensor) -> str | None:
    """The status file a BEGIN payload names (None: the loader raises on failure)."""
    status = _payload(t).get("status")
    return None if status is None else str(status)


def marker(name: str) -> tuple[str, torch.Tensor]:
    """A FINAL or ABORT marker (a one-byte tensor: SGLang forwards tensors only)."""
    return name, torch.zeros(1, dtype=torch.uint8)
