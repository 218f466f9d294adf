"""Small Python values shared over torch.distributed's default group (setup, not refits)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def broadcast_object(value: Any, src: int = 0) -> Any:
    """`value` of rank `src`, on every rank of the default group (collective: all ranks call it).

    Args:
        value: a picklable value (ignored on the other ranks).
        src: the rank whose value everyone gets.

    Returns:
        Rank src's value.
    """
    box = [value if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]
