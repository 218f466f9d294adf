"""What a rollout engine refuses or reports: stale or busy, a tensor it has no place for, a failed update."""

from __future__ import annotations

from domain.errors.base import RefitError
from domain.errors.refit import RefitLifecycleError


class EngineStale(RefitError, RuntimeError):
    """The engine's weights are not a complete refit; it refuses to serve."""


class EngineTensorMismatch(RefitError, ValueError):
    """A refit tensor has no place in the engine, or the wrong shape or dtype for it."""


class EngineBusy(RefitLifecycleError):
    """The engine was asked to serve while a refit is staging or finalizing."""


class EngineUpdateFailed(RefitError, RuntimeError):
    """The rollout engine reported that a weight-update call failed; carries the engine's message."""


class RefitInProgress(RefitLifecycleError):
    """A refit was asked to begin while another caller's refit is in progress on the same engine:
    it did not start, and changed nothing (the other refit goes on)."""


class EngineClosed(RefitLifecycleError):
    """The engine was closed: it neither refits nor serves; build a new one."""


class ServerUnreachable(RefitError, ConnectionError):
    """A server rl-refit attaches to (vLLM's, SGLang's) did not answer: wrong URL, not started yet,
    or died; names the URL and the key that holds it."""


class ServerMismatch(RefitError, ValueError):
    """A server rl-refit attaches to is not one it can refit for this configuration (a route,
    backend, loader or worker extension missing, another rl-refit version, another model, a
    quantization it was not started with): names what differs and the flag or key that fixes it."""
