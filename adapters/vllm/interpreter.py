"""Which Python runs the vLLM server of a disaggregated engine: the configured one, else a `.venv-vllm`
in the working directory or beside this checkout (scripts/setup-vllm-env.sh makes it), else this
interpreter. The composition root passes what it read (the setting, RL_REFIT_VLLM_PYTHON)."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from adapters.vllm.config import PYTHON_VAR
from domain.errors import ConfigError

CHECKOUT = Path(__file__).resolve().parents[2]


def configured_python(setting: str | None, variable: str | None) -> tuple[str, str] | None:
    """(key, value) of the host's python as configured: rollout.engine_kwargs.vllm.python before
    RL_REFIT_VLLM_PYTHON; None when neither sets it."""
    if setting:
        return "rollout.engine_kwargs.vllm.python", str(setting)
    if variable:
        return PYTHON_VAR, variable
    return None


def vllm_python(configured: tuple[str, str] | None, roots: Sequence[Path] | None = None) -> str:
    """The interpreter of a disaggregated engine's vLLM server.

    Args:
        configured: `configured_python(...)`.
        roots: where to look for `.venv-vllm/bin/python` (default: the working directory, then
            this checkout).
    """
    if configured is not None:
        return configured[1]
    for root in roots if roots is not None else (Path.cwd(), CHECKOUT):
        local = root / ".venv-vllm" / "bin" / "python"
        if local.exists():
            return str(local)
    return sys.executable


def host_python(configured: tuple[str, str] | None, roots: Sequence[Path] | None = None) -> str:
    """`vllm_python`, with ConfigError naming the setting when the configured one cannot be run."""
    if configured is not None:
        check_executable(*configured)
    return vllm_python(configured, roots)


def check_executable(key: str, program: str) -> None:
    """ConfigError naming `key` unless `program` (a path, or a name on PATH) can be run."""
    if shutil.which(program) is None:
        why = "does not exist" if not Path(program).exists() else "is not an executable file"
        raise ConfigError(key, f"{program!r} {why}; point it to the python of an environment with vLLM and "
                          "rl-refit installed (scripts/setup-vllm-env.sh makes .venv-vllm), or unset it")
