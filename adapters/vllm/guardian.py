"""The guardian of an attached server: a small process that outlives a trainer killed mid-refit.

A trainer pauses the user's server before a refit and resumes it after. If the trainer dies in
between (SIGKILL, OOM), nothing would resume the server: it would stay paused for good, and,
mid-stream, its workers would hold a half-written model. The guardian, started by the trainer when
it attaches (`Guardian.start`), reads a pipe from the trainer: `begin` when a refit pauses the
server, `end` when the server serves again. When the pipe closes (the trainer is gone, whatever
killed it) in the middle of a refit, it asks the workers to put their previous weights back
(`rl_refit_restore`, with the trainer's session token), drops the prefix cache and resumes the
server; then it exits. When the pipe closes between refits, it just exits.

Its keeper mode watches a server the trainer started itself (adapters.vllm.launcher): when the
pipe closes without the trainer's `release` (the trainer died, whatever killed it), it kills the
server's process group and removes what was made for it (its private directory, its log) and the
shared memory its processes mapped that nothing maps any more, so that nothing of it outlives the
trainer.

It imports the standard library only, so it starts in a fraction of a second.

    python -m adapters.vllm.guardian URL   # stdin: the token, the server's API key (or an empty
                                           # line), then the trainer's words; never in argv
    python -m adapters.vllm.guardian --keep PGID PATH...   # stdin: `release`, or nothing
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from typing import IO, Any

_BEGIN, _END, _RELEASE = "begin", "end", "release"


class Guardian:
    """The trainer's end of the guardian's pipe."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.pipe: IO[bytes] | None = proc.stdin

    @classmethod
    def start(cls, url: str, token: str, api_key: str | None = None) -> Guardian:
        """Start the guardian of the server at `url` for the session `token`."""
        proc = subprocess.Popen([sys.executable, "-m", "adapters.vllm.guardian", url], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        guardian = cls(proc)
        guardian._say(token)
        guardian._say(api_key or "")
        return guardian

    def _say(self, line: str) -> None:
        if self.pipe is not None:
            with contextlib.suppress(OSError):
                self.pipe.write(f"{line}\n".encode())
                self.pipe.flush()

    @classmethod
    def keep(cls, pgid: int, paths: list[str]) -> Guardian:
        """Start the keeper of a server this trainer started: process group `pgid`, and `paths`
        (files or directories) removed with it."""
        proc = subprocess.Popen([sys.executable, "-m", "adapters.vllm.guardian", "--keep", str(pgid), *paths],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        return cls(proc)

    def release(self) -> None:
        """The trainer stops the server itself: the keeper exits without touching it."""
        self._say(_RELEASE)
        self.close()

    def begin(self) -> None:
        """A refit paused the server."""
        self._say(_BEGIN)

    def end(self) -> None:
        """The server serves again (the refit went live, or was restored)."""
        self._say(_END)

    def close(self) -> None:
        """Stop the guardian (between refits: it exits without touching the server)."""
        self._say(_END)
        pipe, self.pipe = self.pipe, None
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)


def _post(url: str, path: str, body: Any = None, query: str = "", api_key: str | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(f"{url}{path}{query}", data=data, method="POST", headers=headers)
    with urllib.request.urlopen(req, timeout=600) as resp:
        raw = resp.read()
    return json.loads(raw) if raw.strip() else None


def rescue(url: str, token: str, api_key: str | None = None) -> None:
    """Put the previous weights back and resume the server (the trainer died mid-refit)."""
    restore = {"record": "Restore", "reason": "the trainer died in the middle of the refit", "token": token}
    _post(url, "/collective_rpc", {"method": "rl_refit_restore", "args": [json.dumps(restore)]}, api_key=api_key)
    for _ in range(20):
        answer = _post(url, "/reset_prefix_cache", query="?reset_running_requests=true", api_key=api_key)
        if not isinstance(answer, dict) or answer.get("success", True):
            break
        time.sleep(0.05)
    _post(url, "/resume", api_key=api_key)


_GRACE_S = 30.0


def _processes() -> dict[str, tuple[str, int]] | None:
    """Every process by pid: its state letter and its process group (/proc/PID/stat); None where
    /proc cannot be read."""
    out: dict[str, tuple[str, int]] = {}
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return None
    for pid in entries:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold anything
            out[pid] = (fields[0], int(fields[2]))
        except (OSError, ValueError, IndexError):
            continue
    return out


def group_runs(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs. A zombie does not: it has exited, maps
    nothing, and waits only for its parent to collect its status."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    processes = _processes()
    return processes is None or any(group == pgid and state != "Z" for state, group in processes.values())


def _group_ends(pgid: int, within_s: float) -> bool:
    """Wait until no process of the group runs (True), or `within_s` passes (False)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not group_runs(pgid):
            return True
        time.sleep(0.1)
    return False


_SHM = "/dev/shm/"


def _shm_mapped(maps: str) -> set[str]:
    return {line.split(_SHM, 1)[1].split()[0] for line in maps.splitlines() if _SHM in line}


def _mapped_shm(pgid: int | None = None) -> set[str]:
    """The files of /dev/shm that live processes map: those of process group `pgid`, or of any
    process (None). Empty where /proc cannot be read."""
    out: set[str] = set()
    for pid, (_state, group) in (_processes() or {}).items():
        if pgid is not None and group != pgid:
            continue
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
            out |= _shm_mapped(f.read())
    return out


def keep(pgid: int, paths: list[str]) -> int:
    """Keeper mode: wait for the pipe to close; without the trainer's `release`, stop the server
    (SIGTERM, then its whole group killed past the grace), remove the paths, and unlink the shared
    memory its processes mapped that no process maps any more (what vLLM's shutdown or Python's
    resource tracker would have released, had they not been killed)."""
    released = False
    for line in sys.stdin:
        released = released or line.strip() == _RELEASE
    if released:
        return 0
    owned = _mapped_shm(pgid)  # the server's segments, read while its processes still map them
    # SIGTERM first: vLLM shuts its engine core and workers down and releases its shared memory
    # (its workers see the dead trainer's transport close and stop waiting for buckets)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pgid, signal.SIGTERM)
    if not _group_ends(pgid, _GRACE_S):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        _group_ends(pgid, _GRACE_S)  # the group's processes exit before their files go
    for path in paths:
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
    for name in owned - _mapped_shm():  # what another process still maps is still in use
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(_SHM, name))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--keep"] and len(args) >= 2 and args[1].isdigit():
        return keep(int(args[1]), args[2:])
    if len(args) != 1:
        print("usage: python -m adapters.vllm.guardian URL  (the session token first on stdin)", file=sys.stderr)
        return 2
    url = args[0].rstrip("/")
    token = sys.stdin.readline().strip()
    api_key = sys.stdin.readline().strip() or None
    in_refit = False
    for line in sys.stdin:
        word = line.strip()
        if word == _BEGIN:
            in_refit = True
        elif word == _END:
            in_refit = False
    if in_refit and token:  # the pipe closed mid-refit: the trainer is gone
        try:
            rescue(url, token, api_key)
        except Exception as err:
            print(f"rl-refit guardian: could not restore the server at {url}: {err}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
