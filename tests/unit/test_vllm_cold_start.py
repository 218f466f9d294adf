"""The one-process cold start (adapters.vllm.cold_start) when it cannot serve: its errors name the
cause and the log, and nothing of it is left running. Its bits against a server of the same
export: tests/vllm/test_cold_host.py."""

from __future__ import annotations

import importlib.util
import os
import pickle
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adapters.vllm.cold_start import ColdProcess
from adapters.vllm.errors import EngineProcessError

ROOT = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_an_environment_without_vllm_fails_the_start_with_the_cause_and_keeps_the_log(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is importable here: this checks an interpreter without it")
    lines: list[str] = []
    with pytest.raises(EngineProcessError) as caught:
        ColdProcess.start(sys.executable, {"model": str(tmp_path)}, env=dict(os.environ), directory=tmp_path,
                          start_timeout_s=120, notify=lines.append)
    message = str(caught.value)
    assert message.startswith("the vLLM engine failed to start: ModuleNotFoundError: "), message
    assert "vllm" in message
    log = Path(message.rsplit("engine log: ", 1)[1])
    assert "Traceback" in log.read_text()  # kept after the failure, with where it was raised
    log.unlink()


def test_an_interpreter_that_exits_at_once_says_how_it_ended(tmp_path: Path) -> None:
    with pytest.raises(EngineProcessError, match=r"^the vLLM engine failed to start: the vLLM engine cold-started "
                       rf"from {tmp_path} \(to compare with\) \(pid \d+\) exited with status 1 at start; engine log: ") as caught:
        ColdProcess.start("/bin/false", {"model": str(tmp_path)}, env=dict(os.environ), directory=tmp_path,
                          start_timeout_s=120)
    Path(str(caught.value).rsplit("engine log: ", 1)[1]).unlink()  # kept after the failure


def test_the_process_exits_by_itself_and_removes_its_log_when_the_trainers_end_closes(tmp_path: Path) -> None:
    mine, theirs = socket.socketpair()
    log = tmp_path / "cold.log"
    log.write_text("")
    with theirs:
        proc = subprocess.Popen([sys.executable, "-m", "adapters.vllm.cold_start", str(theirs.fileno()), str(log)],
                                pass_fds=(theirs.fileno(),), cwd=ROOT)
    mine.close()  # the trainer is gone before it sent the engine's arguments
    assert proc.wait(timeout=120) == 0
    assert not log.exists() and not _alive(proc.pid)


def test_token_ids_and_log_probs_cross_as_plain_lists_and_the_log_probs_keep_their_bits() -> None:
    """A tensor's pickle names what the sender's torch was extended with (Megatron, in a Megatron
    trainer), which the engine's environment may not have: the queries carry lists."""
    served = torch.tensor([[-0.1, -2.5, -1e-30, -17.25]], dtype=torch.float32)
    sent: list[object] = []

    class Conn:
        closed = False

        def send_bytes(self, data: bytes) -> None:
            sent.append(pickle.loads(data))

        def recv_bytes(self) -> bytes:
            return pickle.dumps(("ok", served.tolist()))

    cold = ColdProcess(None, Conn(), Path("."), Path("unused.log"), "the cold start", None)  # type: ignore[arg-type]
    got = cold.log_probs(torch.tensor([[5, 7, 11, 13, 17]]))
    assert sent == [("log_probs", ([[5, 7, 11, 13, 17]],))]
    assert got.dtype == torch.float32 and torch.equal(got, served)
