"""The judgement of `refit demo procs N`: every engine's weights against a single-process refit.

The demo runs the same steps in a world of processes (app.cli.demo_procs) and as a single-process
refit; this module holds the pure parts both sides share: which world a number of processes
makes, the digest of an engine's weights, and the verdict on each engine record.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
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


def judge(records: list[dict[str, Any]], references: list[str]) -> bool:
    """Give every engine record its verdict (`weights`) and say whether all of them hold.

    An engine after a live refit must equal the single-process refit of that step; after a failed
    refit it must hold the last live step's weights bit for bit (kept or restored), or refuse to
    serve (stale, the documented outcome of per-layer engines); a record of a trainer rank has none.

    Args:
        records: one per step and rank: `step`, `rank`, `outcome`, `digest` (None on trainer
            ranks), `stale`.
        references: the single-process refit's engine digest at every step.

    Returns:
        True when no engine holds weights it should not.
    """
    last_live: dict[int, int] = {}
    good = True
    for r in sorted(records, key=lambda r: (r["rank"], r["step"])):
        if r["digest"] is None:
            r["weights"] = "-"
            continue
        if r["outcome"] == "live":
            last_live[r["rank"]] = r["step"]
        if r["stale"]:
            r["weights"] = "stale (refuses to serve)"
            continue
        k = last_live.get(r["rank"])
        want = references[k] if k is not None else None
        if r["outcome"] == "live":
            ok = r["digest"] == want
            r["weights"] = "= single-process" if ok else "DIFFERENT"
        else:
            ok = r["digest"] == want
            r["weights"] = f"kept step {k}, bit-identical" if ok else "CHANGED"
        good = good and ok
    return good
