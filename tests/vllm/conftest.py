"""Fixtures shared by the real-engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cold_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where cold starts of identical exports are shared (one directory for every xdist worker)."""
    root = tmp_path_factory.getbasetemp()
    if root.name.startswith("popen-gw"):  # pytest-xdist: one directory per worker, the session's above them
        root = root.parent
    return root / "rl-refit-cold-starts"


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist registers it when loaded; without xdist (-p no:xdist) the tests that share one
    # server still carry it
    config.addinivalue_line("markers", "xdist_group(name): tests that share one server run in one xdist worker")
