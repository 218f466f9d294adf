"""Errors only the vLLM adapter raises: an engine process that fails, a refit vLLM cannot take in place,
a worker's error of a type that does not cross the worker protocol as itself.

They derive from domain.errors.RefitError and a builtin, as every error does (docs/errors.md); the
domain and the application never name them, so they live beside the code that raises them.
"""

from __future__ import annotations

from domain.errors import EngineUpdateFailed, RefitError


class EngineRefitUnsupported(RefitError, NotImplementedError):
    """The engine cannot take this refit in place without serving wrong weights (e.g. vLLM's CPU
    BF16 experts with a padded intermediate size); refused before anything was written."""


class EngineProcessError(RefitError, RuntimeError):
    """The engine's process failed to start, died, or broke its control protocol; carries the
    end of its log."""


class WorkerError(EngineUpdateFailed):
    """A vLLM worker raised an error of a type that does not cross the worker protocol as itself
    (adapters.vllm.protocol.ERRORS); carries that type's name (`remote_type`) and the worker's
    message."""

    def __init__(self, remote_type: str, message: str) -> None:
        self.remote_type = remote_type
        super().__init__(f"a vLLM worker raised {remote_type}: {message}")


class SessionRefused(RefitError, PermissionError):
    """A worker refused a refit call whose session token is not the one of the trainer that holds
    its refit session (another trainer, or a stranger on the server's port)."""
