"""Configuration errors: a key unknown, removed or of the wrong type, settings that cannot work together."""

from __future__ import annotations

from domain.errors.base import RefitError


class ConfigError(RefitError, ValueError):
    """A configuration key is unknown or has a wrong value. Carries the key."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


class UnsupportedCombination(RefitError, ValueError):
    """Two or more settings cannot work together. Names the keys and what to use instead."""


class UnknownConfigKey(ConfigError, KeyError):
    """A configuration key that the schema does not know. Lists the valid keys."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return ValueError.__str__(self)


class ConfigTypeError(ConfigError, TypeError):
    """A configuration value has the wrong type."""


class RemovedConfigKey(ConfigError):
    """A configuration key (or a form of its value) that was removed; says what replaced it."""
