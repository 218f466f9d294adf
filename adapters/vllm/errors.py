"""Errors only the vLLM adapter raises: an engine process that fails, a refit vLLM cannot take in place.

They derive from domain.errors.RefitError and a builtin, as every error does (docs/errors.md); the
domain and the application never name them, so they live beside the code that raises them.
"""

from __future__ import annotations

from domain.errors import RefitError


class EngineRefitUnsupported(RefitError, NotImplementedError):
    """The engine cannot take this refit in place without serving wrong weights (e.g. vLLM's CPU
    BF16 experts with a padded intermediate size); refused before anything was written."""


class EngineProcessError(RefitError, RuntimeError):
    """The engine's process failed to start, died, or broke its control protocol; carries the
    end of its log."""
