"""The composition root: the only place that reads configuration and the environment.

It builds adapters (importing heavy ones inside the branch that selects them) and hands back
application services. Tests call the same functions with fakes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def read_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment variables rl-refit honours, read once here and passed down as values."""
    env = os.environ if environ is None else environ
    names = ("VERL_FUSED_USE_OP_HOOK", "VERL_ROLLOUT_USE_DEEP_GEMM")
    return {name: env[name] for name in names if name in env}
