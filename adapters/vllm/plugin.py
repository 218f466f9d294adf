"""rl-refit's vLLM plugin: the entry point vLLM calls in each of its processes.

vLLM runs every `vllm.general_plugins` entry point of the installed distributions in its front
end, its engine core and every worker (pyproject.toml declares `register` as
`rl_refit_cpu_emulation`). No rl-refit composition root runs in those processes, so this function
is theirs: it reads the one setting the trainer's composition root passed down in the engine's
environment (`RL_REFIT_VLLM_CPU_EMULATION`, from `rollout.engine_kwargs.vllm.cpu_emulation`) and
hands it to adapters.vllm.cpu_emulation, which does nothing off vLLM's CPU platform.

It also registers rl-refit's weight-transfer backend, `rl_refit` (adapters.vllm.transfer_backend,
imported only when a worker builds it), in vLLM's worker-side factory, so that a server started
with `--weight-transfer-config '{"backend": "rl_refit"}'` finds it (docs/attach.md).
"""

from __future__ import annotations

import os

from adapters.vllm.cpu_emulation import ENV_VAR, apply
from adapters.vllm.session import BACKEND

BACKEND_MODULE = "adapters.vllm.transfer_backend"
BACKEND_CLASS = "RlRefitTransferEngine"


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point: emulated matmuls where this CPU has no kernel,
    and the `rl_refit` weight-transfer backend."""
    apply(os.environ.get(ENV_VAR))
    register_backend()


def register_backend() -> None:
    """`rl_refit` in vLLM's weight-transfer engine factory (idempotent; nothing on a vLLM without
    the weight-transfer subsystem)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, BACKEND_MODULE, BACKEND_CLASS)
