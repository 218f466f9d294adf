"""The vLLM server rl-refit starts itself (adapters.vllm.launcher.ServerProcess), against a fake
server that takes vLLM's flags and answers `/health`: it is started with the engine's arguments as
vLLM's flags, dev mode and a private temporary directory; a server that dies takes its whole
process group with it (what vLLM's engine core and workers are) and the error names how it died;
one that never serves is killed at its start timeout; the log is kept after a failure only; and a
trainer killed with SIGKILL leaves nothing of its server behind (the keeper)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from adapters.vllm.errors import EngineProcessError
from adapters.vllm.launcher import OwnedHttpControl, ServerProcess, server_args

ROOT = Path(__file__).resolve().parents[2]

# Run as `python -m vllm.entrypoints.openai.api_server FLAGS --host H --port P` (the fake python
# ignores `-m MODULE`): records its argv and environment, starts a child in its process group (as
# vLLM's engine core is), writes a file into its TMPDIR (where vLLM's IPC sockets go), then by
# FAKE_SERVER: `serve` answers /health; `silent` never listens; `fail` prints vLLM's kind of error
# and exits 1.
SERVER = textwrap.dedent("""
    import http.server, json, os, subprocess, sys, time
    mode = os.environ["FAKE_SERVER"]
    args = sys.argv[1:]
    out = os.environ["FAKE_DIR"]
    json.dump({"argv": args, "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM", "TMPDIR"))}},
              open(os.path.join(out, "server.json"), "w"))
    # the engine core: it ends with its parent, as vLLM's does (a SIGKILL of the group ends it too)
    child = subprocess.Popen([sys.executable, "-c", "import os, time; p = os.getppid(); "
                              "[time.sleep(0.1) for _ in iter(lambda: os.getppid() == p, False)]"])
    open(os.path.join(out, "child.pid"), "w").write(str(child.pid))
    open(os.path.join(os.environ["TMPDIR"], "ipc-socket"), "w").write("")
    if mode == "silent":
        time.sleep(600)
    if mode == "fail":
        print("(EngineCore pid=1) ERROR 12-02 01:16:29 [core.py:953] ValueError: no kernel for the layer", flush=True)
        print("RuntimeError: Engine core initialization failed. See root cause above.", flush=True)
        sys.exit(1)
    port = int(args[args.index("--port") + 1])

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    http.server.HTTPServer((args[args.index("--host") + 1], port), Handler).serve_forever()
""")


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nshift 2\nexec {sys.executable} {script} \"$@\"\n")  # drops `-m MODULE`
    python.chmod(0o755)
    monkeypatch.setenv("FAKE_DIR", str(tmp_path))

    def start(mode: str, **kwargs: object) -> ServerProcess:
        monkeypatch.setenv("FAKE_SERVER", mode)
        kwargs.setdefault("keeper", False)
        return ServerProcess.start(str(python), {"model": "/m", "seed": 0}, env=dict(os.environ),
                                   log_path=tmp_path / "server.log", **kwargs)  # type: ignore[arg-type]

    return start, tmp_path, python


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split(")")[-1].split()[0] != "Z"


def _wait_for(path: Path, within_s: float = 60.0) -> str:
    deadline = time.monotonic() + within_s  # a generous ceiling: a busy machine starts the fake late
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if text:
            return text
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def _gone(pid: int, within_s: float = 60.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_engine_arguments_become_vllms_flags() -> None:
    args = server_args({"model": "/ckpt", "tensor_parallel_size": 2, "enforce_eager": True,
                        "enable_prefix_caching": False, "lora_target_modules": ["q_proj", "v_proj"],
                        "hf_overrides": {"quantization_config": {"quant_method": "fp8"}}, "revision": None})
    assert args == ["--model", "/ckpt", "--tensor-parallel-size", "2", "--enforce-eager",
                    "--no-enable-prefix-caching", "--lora-target-modules", "q_proj", "v_proj",
                    "--hf-overrides", '{"quantization_config":{"quant_method":"fp8"}}']


def test_the_server_starts_with_rl_refits_backend_dev_mode_and_a_private_temporary_directory(fake) -> None:  # type: ignore[no-untyped-def]
    start, tmp, _ = fake
    server = start("serve")
    seen = json.loads((tmp / "server.json").read_text())
    argv = seen["argv"]
    assert argv[argv.index("--model") + 1] == "/m" and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {"backend": "rl_refit"}
    assert argv[argv.index("--worker-extension-cls") + 1] == "adapters.vllm.extension.RefitWorkerExtension"
    assert server.url == f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    private = Path(seen["env"]["TMPDIR"])
    assert seen["env"]["VLLM_SERVER_DEV_MODE"] == "1" and seen["env"]["VLLM_RPC_BASE_PATH"] == str(private)
    assert (private / "ipc-socket").exists() and oct(private.stat().st_mode & 0o777) == "0o700"
    child = int(_wait_for(tmp / "child.pid"))
    server.close()
    assert not private.exists() and _gone(child)
    assert not (tmp / "server.log").exists()  # a clean run leaves no log


def test_a_server_killed_from_outside_takes_its_engine_processes_with_it_and_is_named(fake) -> None:  # type: ignore[no-untyped-def]
    start, tmp, _ = fake
    server = start("serve")
    child = int(_wait_for(tmp / "child.pid"))
    control = OwnedHttpControl(server.url, server=server)
    os.kill(server.proc.pid, signal.SIGKILL)
    with pytest.raises(EngineProcessError, match=r"was killed by SIGKILL; its engine processes were stopped") as err:
        control.request("GET", "/health")
    assert str(tmp / "server.log") in str(err.value)
    assert _gone(child), "the server's child outlived it"
    control.close()
    assert (tmp / "server.log").exists()  # kept after a failure, and named in the error


def test_a_server_that_never_serves_is_killed_at_its_start_timeout(fake, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from adapters.vllm import launcher

    monkeypatch.setattr(launcher, "_PROGRESS_EVERY_S", 0.5)
    start, tmp, _ = fake
    said: list[str] = []
    with pytest.raises(EngineProcessError, match=r"did not serve within 1\.5 s .*start_timeout_s\) and was killed"):
        start("silent", start_timeout_s=1.5, notify=said.append)
    assert _gone(int(_wait_for(tmp / "child.pid")))
    # never silence while it waits: a line, with what it waits for and for how long
    assert said and all(line.startswith("waiting for the vLLM server (pid ") and "of 1.5 s" in line for line in said)
    assert (tmp / "server.log").exists()


def test_a_cold_start_says_what_it_is_while_it_waits(fake, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from adapters.vllm import launcher

    monkeypatch.setattr(launcher, "_PROGRESS_EVERY_S", 0.5)
    start, tmp, _ = fake
    said: list[str] = []
    role = "the vLLM server cold-started from /export (to compare with)"
    with pytest.raises(EngineProcessError, match=r"^the vLLM server cold-started from /export \(to compare with\) \(pid "):
        start("silent", start_timeout_s=1.5, notify=said.append, role=role)
    assert said and all(line.startswith(f"waiting for {role} (pid ") for line in said)
    assert _gone(int(_wait_for(tmp / "child.pid")))


def test_a_failed_start_leads_with_the_root_cause_and_keeps_the_log(fake) -> None:  # type: ignore[no-untyped-def]
    start, tmp, _ = fake
    with pytest.raises(EngineProcessError) as err:
        start("fail")
    assert str(err.value) == (
        f"the vLLM engine failed to start: ValueError: no kernel for the layer; engine log: {tmp / 'server.log'}")
    assert _gone(int(_wait_for(tmp / "child.pid"))) and (tmp / "server.log").exists()


def test_ctrl_c_while_the_server_starts_stops_it_and_its_processes(fake) -> None:  # type: ignore[no-untyped-def]
    start, tmp, _ = fake
    # Python's own Ctrl-C, whatever an earlier test in this worker process left installed
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(1.0, signal.raise_signal, (signal.SIGINT,))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            start("silent", start_timeout_s=600)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert _gone(int(_wait_for(tmp / "child.pid")))


TRAINER = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, sys.argv[1])
    from adapters.vllm.launcher import ServerProcess
    server = ServerProcess.start(sys.argv[2], {"model": "/m"}, env=dict(os.environ), log_path=sys.argv[3])
    print(json.dumps({"pid": server.proc.pid, "keeper": server.keeper.proc.pid}), flush=True)
    time.sleep(600)  # killed here
""")


def test_a_trainer_killed_with_sigkill_leaves_nothing_of_its_server(fake) -> None:  # type: ignore[no-untyped-def]
    _, tmp, python = fake
    env = {**os.environ, "FAKE_SERVER": "serve", "TMPDIR": str(tmp)}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(ROOT), str(python), str(tmp / "server.log")],
                               stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert trainer.stdout is not None
        line = ""
        while not line.startswith("{"):  # after the log lines
            line = trainer.stdout.readline()
            assert line, "the trainer ended before it started its server"
        started = json.loads(line)
        child = int(_wait_for(tmp / "child.pid"))
        private = Path(json.loads((tmp / "server.json").read_text())["env"]["TMPDIR"])
        assert private.exists() and (tmp / "server.log").exists()
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(60)
        assert _gone(started["keeper"]), "the keeper did not end"
        assert _gone(started["pid"]) and _gone(child), "the server outlived its trainer"
        assert not private.exists() and not (tmp / "server.log").exists()
    finally:
        trainer.kill()
        if trainer.stdout:
            trainer.stdout.close()


_MAPS_SHM = r"""
import mmap, os, sys, time
maps = []
for name in sys.argv[1:]:
    fd = os.open("/dev/shm/" + name, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    maps.append(mmap.mmap(fd, 4096))
print("mapped", flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or not os.path.isdir("/proc"), reason="needs /dev/shm and /proc")
def test_the_keeper_unlinks_the_shared_memory_its_dead_servers_group_mapped() -> None:
    """A server killed before its own shutdown released its shared memory (vLLM's segments,
    Python's resource tracker killed with it): the keeper unlinks what the group mapped, except
    what another live process still maps."""
    import mmap
    import uuid

    from adapters.vllm.guardian import Guardian

    own, shared = (f"rl-refit-test-{uuid.uuid4().hex[:12]}" for _ in range(2))
    server = subprocess.Popen([sys.executable, "-c", _MAPS_SHM, own, shared], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "mapped"
        with open(f"/dev/shm/{shared}", "r+b") as f:  # this process maps it too: still in use
            in_use = mmap.mmap(f.fileno(), 4096)
        keeper = Guardian.keep(server.pid, [])
        assert keeper.pipe is not None
        keeper.pipe.close()  # the trainer is gone, without `release`
        assert keeper.proc.wait(timeout=120) == 0
        server.wait(timeout=30)
        assert not os.path.exists(f"/dev/shm/{own}"), "the dead server's segment was left in /dev/shm"
        assert os.path.exists(f"/dev/shm/{shared}"), "a segment another process maps was unlinked"
        in_use.close()
    finally:
        server.kill()
        for name in (own, shared):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc")
def test_a_group_whose_processes_have_all_exited_no_longer_runs_though_not_yet_reaped() -> None:
    """A zombie, exited and waiting for its parent to collect its status, runs nothing and maps
    nothing: waiting for its group to end must not wait for its parent (a container's init may
    never collect it)."""
    from adapters.vllm.guardian import group_runs

    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                            start_new_session=True)
    try:
        assert group_runs(proc.pid)
        assert proc.stdin is not None
        proc.stdin.close()  # it exits; this process, its parent, does not collect it yet
        deadline = time.monotonic() + 60
        while _alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(proc.pid) and os.path.exists(f"/proc/{proc.pid}"), "the child should be a zombie now"
        assert not group_runs(proc.pid)
    finally:
        proc.kill()
        proc.wait()
