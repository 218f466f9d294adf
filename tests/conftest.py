"""Shared fixtures and seeds."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_logging():  # type: ignore[no-untyped-def]
    """Every test starts with structlog unconfigured: a command run by an earlier test (e.g.
    `refit demo`, which logs at CRITICAL only) must not filter the events a later test captures."""
    import structlog

    import app.logging

    yield
    structlog.reset_defaults()
    app.logging._configured = False


@pytest.fixture
def cli_logging_to_this_tests_stderr():  # type: ignore[no-untyped-def]
    """For tests that run CLI commands in process: `configure_logging` binds the stderr of the
    moment and pytest swaps stderr per test, so each test may configure it afresh; the earlier
    configuration is put back after it."""
    import structlog

    import app.logging

    saved = structlog.get_config()
    app.logging._configured = False
    yield
    structlog.configure(**saved)
