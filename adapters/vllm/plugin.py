"""rl-refit's vLLM plugin: the entry point vLLM calls in each of its processes.

vLLM runs every `vllm.general_plugins` entry point of the installed distributions in its front
end, its engine core and every worker (pyproject.toml declares `register` as
`rl_refit_cpu_emulation`). No rl-refit composition root runs in those processes, so this function
is theirs: it reads the one setting the trainer's composition root passed down in the engine's
environment (`RL_REFIT_VLLM_CPU_EMULATION`, from `rollout.engine_kwargs.vllm.cpu_emulation`) and
hands it to adapters.vllm.cpu_emulation, which does nothing off vLLM's CPU platform.
"""

from __future__ import annotations

import os

from adapters.vllm.cpu_emulation import ENV_VAR, apply


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point: emulated matmuls where this CPU has no kernel."""
    apply(os.environ.get(ENV_VAR))
