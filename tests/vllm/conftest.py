"""Fixtures shared by the real-engine tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm.cold_host import COLD_HOST_ENV

ROOT = Path(__file__).resolve().parents[2]
HOST_START_LIMIT_S = 600  # importing vLLM on 2 loaded cores; only a hang reaches it


@pytest.fixture(scope="session", autouse=True)
def unbound_engine_threads() -> Iterator[None]:
    """vLLM's CPU build binds an engine's worker threads to the first core (VLLM_CPU_OMP_THREADS_BIND=auto
    keeps the last core for its other processes), so the engines of both test workers would share
    core 0 while core 1 waits. Unbound, the system spreads them; each engine still runs one thread
    (vLLM's serving default), and the engines and cold starts a test compares all run alike. Set for
    these tests only (the main suite's tests of the adapter's binding read the environment)."""
    before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    yield
    if before is None:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


@pytest.fixture(scope="session")
def cold_host() -> Iterator[str]:
    """A cold-start host for this worker (tests.vllm.cold_host), its address in COLD_HOST_ENV for
    the scenario processes this worker starts."""
    directory = Path(tempfile.mkdtemp(prefix="rl-refit-cold-host-"))
    address, log = str(directory / "socket"), directory / "host.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.vllm.cold_host", address], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        waited = 0.0
        while not os.path.exists(address):
            if proc.poll() is not None or waited > HOST_START_LIMIT_S:
                pytest.fail(f"the cold-start host did not start ({proc.poll()}): {log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)
            waited += 0.2
        os.environ[COLD_HOST_ENV] = address
        yield address
    finally:
        os.environ.pop(COLD_HOST_ENV, None)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the host and any cold start still running
        proc.wait()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def cold_cache(tmp_path_factory: pytest.TempPathFactory, cold_host: str) -> Path:
    """Where cold starts of identical exports are shared (one directory for every xdist worker);
    the cold starts themselves come from this worker's cold-start host."""
    root = tmp_path_factory.getbasetemp()
    if root.name.startswith("popen-gw"):  # pytest-xdist: one directory per worker, the session's above them
        root = root.parent
    return root / "rl-refit-cold-starts"


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist registers it when loaded; without xdist (-p no:xdist) the tests that share one
    # server still carry it
    config.addinivalue_line("markers", "xdist_group(name): tests that share one server run in one xdist worker")
