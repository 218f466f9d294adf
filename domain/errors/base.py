"""The base class of every error rl-refit raises on purpose.

Each error also subclasses the matching builtin (`class UnsupportedCombination(RefitError,
ValueError)`), so `except ValueError` code keeps working. Messages name the tensor or configuration
key and say what to do instead.
"""

from __future__ import annotations


class RefitError(Exception):
    """Base class of every error rl-refit raises on purpose."""
