"""The judgement of `refit demo procs N`: every engine's weights against a single-process refit.

The demo runs the same steps in a world of processes (app.cli.demo_procs) and as a single-process
refit; this module holds the pure parts both sides share: which world a number of processes
makes, the digest of an engine's weights, and the verdict on each engine record.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from domain.errors import ConfigError
from domain.refit.topology import ParallelLayout, RefitWorld


def demo_world(procs: int, moe: bool) -> RefitWorld:
    """The world of `procs` processes (2..4): 2 = one trainer + one engine; 3 = two trainer ranks
    (ep=2 for an MoE model, else tp=2) + one engine; 4 = two trainer ranks + two engine replicas.

    Raises:
        ConfigError: `--procs` outside 2..4 (what this machine's two cores run).
    """
    if not 2 <= procs <= 4:
        raise ConfigError("--procs", f"must be 2, 3 or 4 on this machine, got {procs}")
    if procs == 2:
        return RefitWorld(ParallelLayout(), 1)
    return RefitWorld(ParallelLayout(ep=2) if moe else ParallelLayout(tp=2), procs - 2)


def weights_digest(weights: Mapping[str, torch.Tensor]) -> str:
    """A short sha256 of every tensor's bytes, by name: equal digests = bit-identical weights."""
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def single_process(references: Sequence[str]) -> Callable[[Mapping[str, Any]], bool]:
    """judge's test of a live engine record: its weights' digest equals the single-process refit's
    engine digest at that step (`references`, one per step)."""
    return lambda record: record["digest"] == references[record["step"]]


def judge(records: list[dict[str, Any]], equals_reference: Callable[[Mapping[str, Any]], bool],
          reference: str = "single-process") -> bool:
    """Give every engine record its verdict (`weights`) and say whether all of them hold.

    An engine after a live refit must equal the reference of that step (`equals_reference`); after
    a failed refit it must hold its last live step's weights bit for bit (kept or restored: the
    same digest), or refuse to serve (stale, the documented outcome of per-layer engines); a
    record of a trainer rank has none.

    Args:
        records: one per step and rank: `step`, `rank`, `outcome`, `digest` (None on trainer
            ranks), `stale`.
        equals_reference: whether a live engine record equals its step's reference
            (`single_process(references)`, or a cold start's verdict).
        reference: what the verdict of a live record names ("= single-process").

    Returns:
        True when no engine holds weights it should not.
    """
    last_live: dict[int, tuple[int, str]] = {}
    good = True
    for r in sorted(records, key=lambda r: (r["rank"], r["step"])):
        if r["digest"] is None:
            r["weights"] = "-"
            continue
        if r["stale"]:
            r["weights"] = "stale (refuses to serve)"
            continue
        if r["outcome"] == "live":
            ok = equals_reference(r)
            last_live[r["rank"]] = (r["step"], r["digest"])
            r["weights"] = f"= {reference}" if ok else "DIFFERENT"
        else:
            k, want = last_live.get(r["rank"], (None, None))
            ok = r["digest"] == want
            r["weights"] = f"kept step {k}, bit-identical" if ok else "CHANGED"
        good = good and ok
    return good
