"""A trainer killed with SIGKILL at each named point of its first refit into the vLLM server it
started (rollout.deployment=disaggregated: begin, the stream, finalize) leaves nothing behind: no
process of the server, nothing in the trainer's temporary directory (the server's private
directory, its log, its IPC sockets), and none of the shared memory in /dev/shm its processes
mapped (the ring is anonymous; vLLM releases its own segments in the shutdown the keeper asks for,
and the keeper unlinks what a killed shutdown left). The trainer runs in the project's `.venv`,
the server in this environment, as `refit demo vllm` runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs the vLLM environment (.venv-vllm), which `make test` creates")

from tests.vllm.test_real_engine import MAIN_PYTHON, ROOT

# The trainer: starts the server, then kills itself with SIGKILL at a named point of its first
# refit: `begin` (the server paused and its workers set up for the update, no bucket sent yet),
# `stream` (its 12th exported tensor: the stream open, the workers waiting for the next bucket) or
# `finalize` (every bucket sent, the update not finished).
TRAINER = r"""
import json, os, signal, sys
from app.bootstrap import bootstrap
from app.services.demo_config import engine_config, with_engine_args
from app.services.engine_demo import EngineDemoSettings
from domain.quant.plan import QuantizationPlan

point = sys.argv[1]
settings = EngineDemoSettings(deployment="disaggregated", plan=QuantizationPlan.from_presets(None, None),
                              model="micro-dense")
services = bootstrap(with_engine_args(engine_config(settings, 0.25), start_timeout_s=900))
engine = services.rollout_engine()
server = engine.workers.control.server
print(json.dumps({"server": server.proc.pid, "keeper": server.keeper.proc.pid}), flush=True)

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

class Killed:
    # the trainer, killed as it exports its Nth tensor

    def __init__(self, inner, at):
        self.inner, self.at = inner, at

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def named_weights(self):
        for i, item in enumerate(self.inner.named_weights()):
            if i == self.at:
                die()
            yield item

class DiesAtFinalize:
    # the engine, through which the trainer dies as it asks the server to finish the update

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def finalize_refit(self, *args, **kwargs):
        die()

trainer = services.trainer_model()
if point == "finalize":
    engine = DiesAtFinalize(engine)
else:
    trainer = Killed(trainer, {"begin": 0, "stream": 12}[point])
services.refit_service(engine=engine, trainer=trainer).refit()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split(")")[-1].split()[0] != "Z"


def _shm_names(maps: str) -> set[str]:
    return {line.split("/dev/shm/", 1)[1].split()[0] for line in maps.splitlines() if "/dev/shm/" in line}


def _group_maps(pgid: int) -> set[str]:
    """The /dev/shm files the processes of group `pgid` map now (the server, its engine core, its
    workers, their resource tracker)."""
    out: set[str] = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                out |= _shm_names((stat.parent / "maps").read_text())
        except (OSError, ValueError, IndexError):
            continue
    return out


@pytest.mark.slow
@pytest.mark.parametrize("point", ["begin", "stream", "finalize"])
def test_a_trainer_killed_mid_refit_leaves_nothing_of_its_server(tmp_path: Path, point: str) -> None:
    if not MAIN_PYTHON.exists():
        pytest.skip(f"{MAIN_PYTHON} is missing: the trainer runs in the project's .venv (`make setup`)")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(TMPDIR=str(tmp), RL_REFIT_VLLM_PYTHON=sys.executable, VLLM_CPU_KVCACHE_SPACE="1")
    with open(tmp_path / "trainer.err", "w+") as err:
        trainer = subprocess.Popen([str(MAIN_PYTHON), "-c", TRAINER, point], cwd=ROOT, env=env,
                                   stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            assert trainer.stdout is not None
            line = " "  # the pids' line, printed once the server serves; "" if the trainer died first
            while line and not line.startswith("{"):
                line = trainer.stdout.readline()
            # what the server's processes map while the trainer lives: the shared memory that is theirs
            # (other tests' engines run beside this one; their segments are not this test's to judge)
            server_shm: set[str] = set()
            deadline = time.monotonic() + 1200
            while trainer.poll() is None and line and time.monotonic() < deadline:
                server_shm |= _group_maps(json.loads(line)["server"])
                time.sleep(0.2)
            trainer.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            trainer.kill()
        err.seek(0)
        assert trainer.returncode == -signal.SIGKILL and line.startswith("{"), err.read()[-3000:]
    started = json.loads(line)
    deadline = time.monotonic() + 120  # the keeper's grace (30 s) twice, on a loaded machine
    while time.monotonic() < deadline and any(_alive(started[k]) for k in ("server", "keeper")):
        time.sleep(0.5)
    assert not _alive(started["server"]), "the server outlived its trainer"
    assert not _alive(started["keeper"]), "the keeper did not end"
    assert sorted(p.name for p in tmp.iterdir()) == [], "the trainer's temporary directory is not empty"
    assert server_shm, "the server's processes mapped no shared memory: this test could not see what it checks"
    left = server_shm & set(os.listdir("/dev/shm"))
    assert not left, f"the server's shared memory is left in /dev/shm: {sorted(left)} (of {sorted(server_shm)})"
