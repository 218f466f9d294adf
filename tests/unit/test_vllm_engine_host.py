"""The disaggregated engine host's lifecycle (adapters.vllm.remote.EngineProcess) against a fake host
that speaks the control protocol: a host that dies takes its whole process group with it (what
vLLM's engine core, workers and resource tracker are), the error names how it died, a host that
never connects is killed at its start timeout, and the log is kept after a failure only."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import attrs
import pytest

from adapters.vllm.control import HostGreedy, Tokens
from adapters.vllm.errors import EngineProcessError
from adapters.vllm.remote import EngineProcess

ROOT = Path(__file__).resolve().parents[2]

# Started as `python -m adapters.vllm.server SPEC`: connects back, proves the token, starts a child
# in its process group (as vLLM's engine core is), writes the child's pid next to the spec's
# `pid_file`, answers `Shutdown` with Done, a worker request with one worker's error, log-probs
# with the host's own error, and any other request with no tokens.
HOST = textwrap.dedent("""
    import json, os, socket, subprocess, sys, time
    sys.path.insert(0, os.environ["ROOT"])
    spec = json.load(open(sys.argv[-1]))
    mode = os.environ["FAKE_HOST"]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(os.environ["CHILD_PID_FILE"], "w").write(str(child.pid))
    if mode == "silent":
        time.sleep(600)
    from adapters.vllm.control import Channel, Hello, Tokens, WorkerAnswers
    from adapters.vllm.protocol import Done, ErrorReply, ReadyReply
    from domain.errors import CollectiveTimeout, TransportAborted
    channel = Channel(socket.create_connection((spec["trainer_host"], spec["trainer_port"])), "the trainer")
    if mode == "fail":
        print("ValueError: Failed to find a kernel that can implement the layer. Reasons:", flush=True)
        error = ErrorReply("RuntimeError", "wrapper").to_plain()
        channel.send(Hello(spec["token"], os.getpid(), error=error).to_plain())
        sys.exit(1)
    open(os.path.join(spec["private_dir"], "ipc-socket"), "w").write("")  # where vLLM's IPC sockets go
    channel.send(Hello(spec["token"], os.getpid(), [ReadyReply(0, "cpu", os.getpid()).to_plain()]).to_plain())
    while True:
        message = channel.receive(None)
        if message["record"] == "Shutdown":
            channel.send(Done().to_plain())
            child.kill()
            sys.exit(0)
        if message["record"] == "CallWorkers":  # worker 0 answers, worker 1 raised
            aborted = ErrorReply.of(TransportAborted("rank 2: the source aborted"))
            channel.send(WorkerAnswers([Done().to_plain(), aborted.to_plain()]).to_plain())
        elif message["record"] == "HostLogProbs":  # the host's own request failed
            channel.send(ErrorReply.of(CollectiveTimeout(1, "bucket 3", 5.0, (0,))).to_plain())
        else:
            channel.send(Tokens([]).to_plain())
""")


@pytest.fixture
def fake_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    script = tmp_path / "host.py"
    script.write_text(HOST)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    python.chmod(0o755)
    monkeypatch.setenv("ROOT", str(ROOT))
    monkeypatch.setenv("CHILD_PID_FILE", str(tmp_path / "child.pid"))

    def start(mode: str, **kwargs: object) -> EngineProcess:
        monkeypatch.setenv("FAKE_HOST", mode)
        return EngineProcess.start(str(python), {}, log_path=tmp_path / "host.log", **kwargs)  # type: ignore[arg-type]

    return start, tmp_path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split(")")[-1].split()[0] != "Z"


def _child(tmp_path: Path) -> int:
    for _ in range(1200):  # a generous ceiling (60 s): a busy machine starts the fake host late
        text = (tmp_path / "child.pid").read_text() if (tmp_path / "child.pid").exists() else ""
        if text:
            return int(text)
        time.sleep(0.05)
    raise AssertionError("the fake host wrote no child pid")


def _gone(pid: int, within_s: float = 60.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_host_killed_from_outside_takes_its_engine_processes_with_it_and_is_named(fake_host) -> None:  # type: ignore[no-untyped-def]
    start, tmp = fake_host
    process = start("serve")
    child = _child(tmp)
    os.kill(process.proc.pid, signal.SIGKILL)
    with pytest.raises(EngineProcessError, match=r"was killed by SIGKILL; its engine processes were stopped") as err:
        process.call(HostGreedy([[1]], 1))
    assert str(tmp / "host.log") in str(err.value)
    assert _gone(child), "the engine host's child outlived it"
    process.close()
    assert (tmp / "host.log").exists()  # kept after a failure, and named in the error


def test_a_clean_close_stops_everything_and_removes_the_log(fake_host) -> None:  # type: ignore[no-untyped-def]
    start, tmp = fake_host
    process = start("serve")
    child = _child(tmp)
    assert process.call(HostGreedy([[1]], 1)) == Tokens([])
    process.close()
    assert process.proc.returncode == 0 and _gone(child)
    assert not (tmp / "host.log").exists()


def test_a_host_that_never_connects_is_killed_at_its_start_timeout(fake_host, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from adapters.vllm import remote

    monkeypatch.setattr(remote, "_PROGRESS_EVERY_S", 0.5)
    start, tmp = fake_host
    said: list[str] = []
    began = time.monotonic()
    with pytest.raises(EngineProcessError, match=r"did not connect within 1\.5 s .*start_timeout_s\) and was killed"):
        start("silent", start_timeout_s=1.5, notify=said.append)
    assert time.monotonic() - began < 60  # a generous ceiling: the wait ends at the start timeout, not never
    assert _gone(_child(tmp))
    # never silence while it waits: a line, with what it waits for and for how long
    assert said and all(line.startswith("waiting for the vLLM engine host (pid ") and "of 1.5 s" in line
                        for line in said)


def test_a_failed_start_leads_with_the_root_cause_and_keeps_the_log(fake_host) -> None:  # type: ignore[no-untyped-def]
    start, tmp = fake_host
    with pytest.raises(EngineProcessError) as err:
        start("fail")
    assert str(err.value) == (
        "the vLLM engine failed to start: ValueError: Failed to find a kernel that can implement the layer. "
        f"Reasons:; engine log: {tmp / 'host.log'}")
    assert _gone(_child(tmp)) and (tmp / "host.log").exists()


def test_ctrl_c_while_the_engine_starts_stops_it_and_its_processes_at_once(fake_host) -> None:  # type: ignore[no-untyped-def]
    start, tmp = fake_host
    # Python's own Ctrl-C, whatever an earlier test in this worker process left installed
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, signal.raise_signal, (signal.SIGINT,))
    timer.start()
    began = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            start("silent", start_timeout_s=300)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - began < 60  # a generous ceiling, far below the start timeout it did not wait out
    assert _gone(_child(tmp))


def test_errors_of_the_host_and_of_any_worker_are_raised_as_their_own_class(fake_host) -> None:  # type: ignore[no-untyped-def]
    from adapters.vllm.control import HostLogProbs
    from adapters.vllm.protocol import Abort
    from domain.errors import CollectiveTimeout, TransportAborted

    start, _ = fake_host
    process = start("serve")
    with pytest.raises(TransportAborted, match=r"^rank 2: the source aborted$"):
        process.workers_call(Abort())  # worker 0 succeeded; worker 1's error is not lost
    with pytest.raises(CollectiveTimeout) as err:
        process.call(HostLogProbs([[1, 2, 3]]))
    assert (err.value.rank, err.value.step, err.value.seconds, err.value.peers) == (1, "bucket 3", 5.0, (0,))
    assert process.call(HostGreedy([[1]], 1)) == Tokens([])  # the channel is still in step
    process.close()
    assert process.proc.returncode == 0


@pytest.mark.parametrize("deployment", ["disaggregated", "colocated"])
def test_an_engine_that_does_not_start_leaves_no_model_directory_behind(deployment, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The embedded model's config.json directory is made for the engine; when the engine never
    starts, nothing would close it, so the factory removes it before the error propagates."""
    import tempfile

    import adapters.vllm.client
    import adapters.vllm.remote
    from adapters.vllm.factory import build_vllm_engine
    from app.bootstrap import bootstrap
    from app.cli.demo_engine import engine_config
    from app.composition.tables import engine_start
    from app.services.engine_demo import EngineDemoSettings
    from domain.quant.plan import QuantizationPlan

    def refuse(*_args, **_kwargs):  # type: ignore[no-untyped-def]
        raise EngineProcessError("the vLLM engine failed to start: ValueError: no kernel")

    monkeypatch.setattr(adapters.vllm.remote.EngineProcess, "start", refuse)
    monkeypatch.setattr(adapters.vllm.client.ExtensionWorkers, "launch", refuse)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    settings = EngineDemoSettings(deployment=deployment, plan=QuantizationPlan.from_presets(None, None), model="micro-dense")
    services = bootstrap(engine_config(settings, 1))
    made: list[Path] = []

    def model_dir() -> Path:
        made.append(services.embedded.model_dir())
        return made[-1]

    host = attrs.evolve(services.vllm_host(), export_environment=lambda env: None, embedded_model_dir=model_dir)
    with pytest.raises(EngineProcessError, match="no kernel"):
        build_vllm_engine(services.config.rollout.engine_kwargs.vllm, engine_start(services, "vllm"), host,
                          deployment=deployment)
    assert len(made) == 1 and made[0].parent == tmp_path and not made[0].exists()


def test_the_engines_temporary_files_go_into_a_directory_of_its_own_removed_with_it(fake_host) -> None:  # type: ignore[no-untyped-def]
    start, _ = fake_host
    process = start("serve")
    assert process.reaper is not None and process.reaper.private_dir is not None
    private = process.reaper.private_dir
    assert (private / "ipc-socket").exists()  # the host's files landed there, not in the temp directory
    process.close()
    assert not private.exists()


def test_a_worker_error_keeps_the_log_the_error_may_name(fake_host) -> None:  # type: ignore[no-untyped-def]
    from adapters.vllm.protocol import Abort
    from domain.errors import TransportAborted

    start, tmp = fake_host
    process = start("serve")
    with pytest.raises(TransportAborted):
        process.workers_call(Abort())
    process.close()
    assert process.proc.returncode == 0  # a clean shutdown, yet
    assert (tmp / "host.log").exists()  # kept: a worker failed on this engine

