"""SGLang's custom weight loader for refits (`custom_weight_loader` / `load_format`: LOADER_PATH).

It runs inside SGLang's scheduler process, one call per `update_weights_from_tensor`, on the
served model. Per refit (one weight-update session):

- BEGIN marker: capture every parameter and buffer (object and storage: what CUDA graphs hold),
  drop the previous session's skip guards. Nothing is copied yet.
- tensors: those the staging rule names (MXFP8 scales, FP4 expert tensors) are copied and held;
  the others go straight to `model.load_weights` (which copies them into the parameters). Just
  before a tensor is loaded, the engine tensors it can overwrite are backed up (CPU by default):
  those of its decoder layer (`layers.N`), or of its module outside the layers. A refit thus
  backs up what it overwrites, one layer at a time as it goes, never the buffers and modules it
  does not touch (rotary caches, a tower it does not send).
- FINAL marker: load the held tensors (their layers backed up first), run every quant method's
  `process_weights_after_loading` once (its module backed up first), and copy each result back
  into the captured storage (a post-processing that rebinds a parameter, or its `.data`, is
  undone; one that changes a shape or dtype fails the refit). Then arm skip guards so that
  SGLang's `end_weight_update` does not post-process a second time.
- any failure, or the ABORT marker: copy the backup into the captured storage (newest first, so
  that storage reached from two groups gets its oldest, pre-refit copy last), re-register the
  captured objects, arm the skip guards, and (on failure) raise.

What "can overwrite" assumes: SGLang writes a checkpoint tensor of decoder layer N into the
engine's decoder layer N (layer indices stay global under pipeline parallelism) and a tensor
outside the decoder layers into a module outside them. A tensor whose layer or module the engine
does not have backs up every module outside the decoder layers.
"""

from __future__ import annotations

import json
import os
import re
import time
import weakref
from collections.abc import Iterable
from typing import Any

import attrs
import structlog
import torch
from torch import nn

from adapters.sglang.staging import (
    ABORT_MARKER,
    BEGIN_MARKER,
    FINAL_MARKER,
    MARKER_PREFIX,
    StagingRule,
    status_of,
)
from domain.errors import EngineTensorMismatch, RefitLifecycleError, StorageRebound

log = structlog.get_logger()

_ORIGINAL = "_rl_refit_original"
_LOADERS: weakref.WeakKeyDictionary[nn.Module, RefitLoader] = weakref.WeakKeyDictionary()
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def backup_group(name: str) -> str:
    """The unit a refit backs up: `layers.N` for a decoder layer's tensors (checkpoint and engine
    names alike), else the module path without a leading `model.` (`embed_tokens`, `lm_head`).

    Args:
        name: a checkpoint or engine tensor name.

    Returns:
        The group key.
    """
    m = _LAYER.search(name)
    if m:
        return f"layers.{m.group(1)}"
    return name.rpartition(".")[0].removeprefix("model.") or name


@attrs.frozen
class _Captured:
    module: nn.Module
    local: str
    obj: torch.Tensor  # the registered Parameter / buffer object
    alias: torch.Tensor  # its storage at capture time
    is_param: bool
    group: str

    @property
    def view(self) -> tuple[object, ...]:
        """Identifies identical views (a tied weight registered twice): one backup serves both."""
        a = self.alias
        return a.data_ptr(), tuple(a.shape), a.stride(), a.dtype


def load(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom-loader entry point: `custom_loader(model, named_tensors)`."""
    loader = _LOADERS.get(model)
    if loader is None:
        loader = _LOADERS[model] = RefitLoader(model)
    loader.receive(list(named_tensors))


def write_status(path: str, status: dict[str, object]) -> None:
    """Replace the status file at once (the trainer never reads half of it)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(status, f)
    os.replace(tmp, path)


def loader_for(model: nn.Module) -> RefitLoader | None:
    """The loader state of a model (tests, diagnostics)."""
    return _LOADERS.get(model)


def _registered(c: _Captured) -> torch.Tensor | None:
    table = c.module._parameters if c.is_param else c.module._buffers
    return table.get(c.local)


def _same_storage(t: torch.Tensor | None, c: _Captured) -> bool:
    return (t is not None and t.data_ptr() == c.alias.data_ptr() and t.shape == c.alias.shape
            and t.stride() == c.alias.stride() and t.dtype == c.alias.dtype)


@attrs.define
class RefitLoader:
    """One model's refit state inside the engine process.

    Attributes:
        model: the served model.
        backup_device: where the pre-refit values are kept for a restore.
        rule: the staging rule of the current refit.
        refit_id: the current (or last) refit's id.
        active: True between BEGIN and FINAL/ABORT.
        postprocess_counts: module name -> post-processings in the current refit.
        peak_staging_bytes: the most bytes held back at once in the current refit.
        peak_backup_bytes: the most bytes of backup held at once in the current (or last) refit.
        backed_up: the engine tensors the current (or last) refit backed up, in backup order.
    """

    model: nn.Module
    backup_device: torch.device = attrs.field(factory=lambda: torch.device("cpu"))
    rule: StagingRule = attrs.field(factory=StagingRule)
    refit_id: int | None = None
    active: bool = False
    postprocess_counts: dict[str, int] = attrs.field(factory=dict)
    peak_staging_bytes: int = 0
    peak_backup_bytes: int = 0
    backed_up: list[str] = attrs.field(factory=list)
    _captured: dict[str, _Captured] = attrs.field(factory=dict)
    _groups: dict[str, list[str]] = attrs.field(factory=dict)
    _by_module: dict[int, list[str]] = attrs.field(factory=dict)
    _backed_groups: set[str] = attrs.field(factory=set)
    _backup: dict[str, torch.Tensor] = attrs.field(factory=dict)
    _views: dict[tuple[object, ...], torch.Tensor] = attrs.field(factory=dict)
    _backup_bytes: int = 0
    _staged: list[tuple[str, torch.Tensor]] = attrs.field(factory=list)
    status_path: str | None = None  # where each call's outcome is written (None: failures raise)
    calls: int = 0  # calls of the current refit, BEGIN's included

    def receive(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Handle one `update_weights_from_tensor` call (markers first/last, tensors between).

        When the refit's BEGIN marker names a status file (the attached deployment), a failure is
        restored and written there instead of raised: SGLang does not catch a custom loader's
        exception, and its scheduler process stops on it, taking the server down.
        """
        if named and named[0][0] == BEGIN_MARKER:
            self.status_path, self.calls = status_of(named[0][1]), 0
        if self.status_path is None:
            self._receive(named)
            return
        self.calls += 1
        error: str | None = None
        restored = True
        try:
            self._receive(named)
        except Exception as err:
            error = f"{type(err).__name__}: {err}"
            try:
                self.abort(error)  # nothing to do when the failure already restored
            except Exception as again:
                restored = False
                error = f"{error}; restore failed: {type(again).__name__}: {again}"
        write_status(self.status_path, {"refit_id": self.refit_id, "call": self.calls, "error": error,
                                        "restored": restored})

    def _receive(self, named: list[tuple[str, torch.Tensor]]) -> None:
        if named and named[0][0] == BEGIN_MARKER:
            self._begin(named.pop(0)[1])
        end = named.pop()[0] if named and named[-1][0] in (FINAL_MARKER, ABORT_MARKER) else None
        stray = [n for n, _ in named if n.startswith(MARKER_PREFIX)]
        if stray:
            self._fail_with(EngineTensorMismatch(f"refit marker {stray[0]!r} out of place; BEGIN comes first, "
                                                 "FINAL or ABORT last"))
        if named:
            self._load(named)
        if end == FINAL_MARKER:
            self._final()
        elif end == ABORT_MARKER:
            self.abort("abort marker")

    # --- steps ----------------------------------------------------------------------------

    def _begin(self, payload: torch.Tensor) -> None:
        if self.active:
            self.abort(f"refit {self.refit_id} was never finalized")
        self.refit_id, self.rule = StagingRule.from_tensor(payload)
        disarm_skip_guards(self.model)
        self._captured, self._groups, self._by_module = {}, {}, {}
        for mname, module in self.model.named_modules():
            for table, is_param in ((module._parameters, True), (module._buffers, False)):
                for local, t in table.items():
                    if t is not None:
                        name = f"{mname}.{local}" if mname else local
                        self._captured[name] = _Captured(module, local, t, t.data, is_param, backup_group(name))
                        self._groups.setdefault(backup_group(name), []).append(name)
                        self._by_module.setdefault(id(module), []).append(name)
        self._backup, self._views, self._backed_groups = {}, {}, set()
        self._backup_bytes = self.peak_backup_bytes = 0
        self.backed_up = []
        self._staged = []
        self.postprocess_counts = {}
        self.peak_staging_bytes = 0
        self.active = True

    # --- the backup: what a refit is about to overwrite, group by group -------------------

    def _back_up_for(self, names: Iterable[str]) -> None:
        """Back up the groups the tensors `names` (checkpoint names) can write into."""
        for group in dict.fromkeys(backup_group(n) for n in names):
            if group in self._backed_groups:
                continue
            if group in self._groups:
                self._back_up_group(group)
            else:  # the engine has no such layer or module: whatever lies outside the layers
                log.debug("sglang refit backs up every module outside the layers", refit_id=self.refit_id,
                          unknown_group=group)
                for other in self._groups:
                    if not other.startswith("layers."):
                        self._back_up_group(other)
                self._backed_groups.add(group)

    def _back_up_group(self, group: str) -> None:
        if group in self._backed_groups:
            return
        with torch.no_grad():
            for name in self._groups[group]:
                c = self._captured[name]
                copy = self._views.get(c.view)
                if copy is None:
                    copy = self._views[c.view] = c.alias.detach().to(self.backup_device, copy=True)
                    self._backup_bytes += copy.nbytes
                self._backup[name] = copy
                self.backed_up.append(name)
        self._backed_groups.add(group)
        self.peak_backup_bytes = max(self.peak_backup_bytes, self._backup_bytes)

    def _load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        if not self.active:
            raise RefitLifecycleError("refit tensors arrived before the BEGIN marker; begin the refit first")
        now = []
        for name, t in named:
            engine_name = self.rule.engine_name(name)
            if self.rule.must_stage(name):
                self._staged.append((engine_name, t.clone()))  # t may alias the sender's buffer
            else:
                now.append((engine_name, t))
        self.peak_staging_bytes = max(self.peak_staging_bytes, sum(t.nbytes for _, t in self._staged))
        try:
            if now:
                self._back_up_for(n for n, _ in now)
                self._load_weights(now)
        except Exception as err:
            self._fail_with(err)

    def _final(self) -> None:
        if not self.active:
            raise RefitLifecycleError("FINAL marker without a refit in progress")
        try:
            if self._staged:
                staged, self._staged = self._staged, []
                self._back_up_for(n for n, _ in staged)
                self._load_weights(staged)
            t0 = time.perf_counter()
            for mname, module in self.model.named_modules():
                qm = getattr(module, "quant_method", None)
                if qm is not None and hasattr(qm, "process_weights_after_loading"):
                    self._back_up_module(module)
                    _original(qm)(module)
                    self.postprocess_counts[mname] = self.postprocess_counts.get(mname, 0) + 1
                    self._keep_storage(mname, module)
            changed = [n for n, c in self._captured.items() if not _same_storage(_registered(c), c)]
            if changed:
                raise StorageRebound(f"refit {self.refit_id}: captured tensors rebound after post-processing: "
                                     f"{changed[:3]}")
            log.debug("sglang refit rebuilt", refit_id=self.refit_id, seconds=time.perf_counter() - t0)
        except Exception as err:
            self._fail_with(err)
        self._close()

    def _back_up_module(self, module: nn.Module) -> None:
        """Post-processing rewrites its module's tensors: their groups are backed up first (in a
        full refit they are already)."""
        for group in dict.fromkeys(self._captured[n].group for n in self._by_module.get(id(module), ())):
            self._back_up_group(group)

    def _keep_storage(self, mname: str, module: nn.Module) -> None:
        """Copy what post-processing produced into the captured storage; re-register it."""
        prefix = f"{mname}." if mname else ""
        mine = {n: self._captured[n] for n in self._by_module.get(id(module), ())}
        for name, c in mine.items():
            current = getattr(module, c.local, None)
            if _same_storage(current, c) and current is c.obj:
                continue
            if not isinstance(current, torch.Tensor):
                raise StorageRebound(f"post-processing removed captured tensor {name!r}; the kernel layout changed")
            if current.shape != c.alias.shape or current.dtype != c.alias.dtype:
                raise StorageRebound(
                    f"post-processing turned captured tensor {name!r} from {c.alias.dtype} {tuple(c.alias.shape)} "
                    f"into {current.dtype} {tuple(current.shape)}; captured storage cannot hold it"
                )
            with torch.no_grad():
                if current.data_ptr() != c.alias.data_ptr():
                    c.alias.copy_(current.detach())
            self._register(c)
        for table in (module._parameters, module._buffers):
            extra = [local for local, v in table.items() if v is not None and prefix + local not in mine]
            if extra:
                raise StorageRebound(f"post-processing added tensors {[prefix + e for e in extra]} that no "
                                     "captured graph knows; the kernel layout changed")

    @staticmethod
    def _register(c: _Captured) -> None:
        c.obj.data = c.alias
        if c.is_param:
            c.module._parameters[c.local] = c.obj  # type: ignore[assignment]
        else:
            c.module._buffers[c.local] = c.obj
        if c.module.__dict__.get(c.local) is not None:  # a plain attribute shadowing it
            del c.module.__dict__[c.local]

    # --- failure -----------------------------------------------------------------------------

    def _load_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        load_weights = self.model.load_weights  # every SGLang model class defines it
        load_weights(named)  # type: ignore[operator]

    def _fail_with(self, err: Exception) -> None:
        self.abort(f"{type(err).__name__}: {err}")
        raise err

    def abort(self, reason: str) -> None:
        """Restore every captured tensor's pre-refit value in its captured storage."""
        if not self.active:
            return
        with torch.no_grad():
            for name in reversed(self.backed_up):  # newest first: shared storage ends on its oldest copy
                self._captured[name].alias.copy_(self._backup[name])
            for c in self._captured.values():
                self._register(c)
        known = {(id(c.module), c.local) for c in self._captured.values()}
        for module in {id(c.module): c.module for c in self._captured.values()}.values():
            for table in (module._parameters, module._buffers):
                for local in [k for k, v in table.items() if v is not None]:
                    if (id(module), local) not in known:
                        del table[local]
        log.warning("sglang refit restored the live weights", refit_id=self.refit_id, reason=reason)
        self._close()

    def _close(self) -> None:
        self._staged = []
        self._backup, self._views, self._backup_bytes = {}, {}, 0
        self.active = False
        arm_skip_guards(self.model)


# --- skip guards: SGLang's end_weight_update must not post-process a second time ---------------


def _quant_methods(model: nn.Module) -> list[object]:
    seen: dict[int, object] = {}
    for module in model.modules():
        qm = getattr(module, "quant_method", None)
        if qm is not None and hasattr(qm, "process_weights_after_loading"):
            seen.setdefault(id(qm), qm)
    return list(seen.values())


def _original(qm: object) -> Any:
    method = qm.process_weights_after_loading  # type: ignore[attr-defined]
    return getattr(method, _ORIGINAL, method)


def arm_skip_guards(model: nn.Module) -> int:
    """Make every quant method's `process_weights_after_loading` a no-op until disarmed
    (idempotent). Returns how many were armed now."""
    armed = 0
    for qm in _quant_methods(model):
        if hasattr(qm.process_weights_after_loading, _ORIGINAL):  # type: ignore[attr-defined]
            continue

        def skip(layer: nn.Module, *args: object, **kwargs: object) -> None:
            return None

        setattr(skip, _ORIGINAL, qm.process_weights_after_loading)  # type: ignore[attr-defined]
        qm.__dict__["process_weights_after_loading"] = skip
        armed += 1
    return armed


def disarm_skip_guards(model: nn.Module) -> int:
    """Undo arm_skip_guards (idempotent). Returns how many were disarmed."""
    disarmed = 0
    for qm in _quant_methods(model):
        if hasattr(qm.__dict__.get("process_weights_after_loading"), _ORIGINAL):
            del qm.__dict__["process_weights_after_loading"]
            disarmed += 1
    return disarmed
