"""What rl-refit's loader did with each call of a refit, read back by the trainer.

SGLang 0.5.23 does not catch a custom loader's exception: its scheduler process stops on it, and
the server (or the `sglang.Engine`) goes down. So the trainer names a status file in the refit's
BEGIN marker; the loader then restores a failure and writes it there instead of raising
(adapters.sglang.loader.RefitLoader.receive), and the trainer reads that file after every call.
The file lives in a private directory (0700) of the trainer's: the engine runs on this host, as
this user (the tensors reach it through shared memory anyway).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import weakref
from pathlib import Path

import attrs

from adapters.sglang.engine import NamedTensors
from adapters.sglang.staging import BEGIN_MARKER, StagingRule, with_status


@attrs.define
class LoaderStatus:
    """The trainer's side of the loader's status file (one per engine).

    Attributes:
        where: the engine, in words, for messages.
        unrestored: why the loader could not restore the previous weights (None: it could, or
            nothing failed); set until the next refit begins.
    """

    where: str
    unrestored: str | None = attrs.field(init=False, default=None)
    _dir: str = attrs.field(init=False)
    _refit_id: int | None = attrs.field(init=False, default=None)
    _calls: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="rl-refit-sglang-")
        weakref.finalize(self, shutil.rmtree, self._dir, True)

    @property
    def path(self) -> str:
        return str(Path(self._dir) / "status.json")

    @property
    def directory(self) -> str:
        return self._dir

    def outgoing(self, named: NamedTensors) -> NamedTensors:
        """The call's tensors, its BEGIN marker naming the status file; counts the call."""
        named = list(named)
        if named and named[0][0] == BEGIN_MARKER:
            self._refit_id, _ = StagingRule.from_tensor(named[0][1])
            self._calls, self.unrestored = 0, None
            Path(self.path).unlink(missing_ok=True)
            named[0] = (BEGIN_MARKER, with_status(named[0][1], self.path))
        self._calls += 1
        return named

    def refused(self) -> tuple[bool, str] | None:
        """(False, why) when an earlier call of this refit could not be restored (nothing more is sent)."""
        if self.unrestored is None:
            return None
        return False, f"rl-refit's loader could not restore the previous weights: {self.unrestored}"

    def outcome(self) -> tuple[bool, str]:
        """(success, message) of the last call, as the loader wrote it."""
        try:
            status = json.loads(Path(self.path).read_text())
        except (OSError, ValueError):
            status = None
        if not isinstance(status, dict) or status.get("refit_id") != self._refit_id or status.get("call") != self._calls:
            return False, (f"{self.where} did not report what rl-refit's loader did with call {self._calls} of refit "
                           f"{self._refit_id}: run it on this host, as this user, with the same rl-refit installed")
        error = status.get("error")
        if error is None:
            return True, "Success"
        if not status.get("restored", True):
            self.unrestored = str(error)
            return False, f"rl-refit's loader failed and could not restore the previous weights: {error}"
        return False, f"rl-refit's loader failed ({error}); the engine restored its previous weights"

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)
