"""rl-refit's vLLM worker extension: the receiving end of a refit, inside every vLLM worker.

Start the engine with `worker_extension_cls="adapters.vllm.extension.RefitWorkerExtension"`
(engine_args.EXTENSION); vLLM mixes the class into its worker class, and `LLM.collective_rpc`
calls its methods by name. Every method is named `rl_refit_*` (vLLM refuses an extension whose
names its worker already has) and takes and returns plain values only (ints, strings, lists,
dicts, bytes): with vLLM's multiprocess engine (the default) collective_rpc arguments cross
msgpack, where a tensor arrives as `[dtype, shape, buffer]` and its data is lost.

Two ways in:
- colocated (trainer and engine in one process, `VLLM_ENABLE_V1_MULTIPROCESSING=0`):
  `rl_refit_load(named_tensors)` receives a bucket's tensors by reference;
- disaggregated (the engine in its own process): `rl_refit_join` joins a side process group
  with the trainer (adapters.distributed.side_group, gloo on CPU, NCCL on GPU), and
  `rl_refit_receive` receives one refit's whole bucket stream over it
  (adapters.distributed.transport.TorchDistTransport) and loads each bucket as it lands.

Either way the buckets go through WorkerRefit: vLLM's layerwise reload, the expert redo, the
written/unwritten count and the KV-cache scale reset.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
from contextlib import AbstractContextManager
from typing import Any

import structlog
import torch

from adapters.vllm.hooks import VllmHooks
from adapters.vllm.worker import KV_SCALE_NAMES, WorkerRefit
from domain.refit.buckets import Bucket, unpack_bucket

log = structlog.get_logger()

_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile-data permission in this process (x86-64 only; True when granted).

    vLLM's CPU kernels run AMX instructions on short prompts without asking for it first, and
    the worker then dies with SIGILL on its first request when that request has fewer than 5
    tokens; the oneDNN path used for longer ones asks. Asking once at start is harmless.
    """
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes (what "the same weights" means, bit for bit)."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class RefitWorkerExtension:
    """Methods vLLM mixes into its worker class; `self` is vLLM's worker."""

    # --- the worker's refit state -------------------------------------------------------------

    def _rl_refit_state(self) -> WorkerRefit:
        refit = getattr(self, "_rl_refit", None)
        if refit is None:
            request_amx_permission()
            refit = WorkerRefit(
                model=self.model_runner.get_model(),  # type: ignore[attr-defined]
                model_config=self.vllm_config.model_config,  # type: ignore[attr-defined]
                hooks=VllmHooks.from_vllm(),
            )
            self._rl_refit = refit
        return refit

    def _rl_refit_context(self) -> AbstractContextManager[object]:
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(self.vllm_config)  # type: ignore[attr-defined]

    def _rl_refit_load_named(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket's tensors, however they arrived (tests override this to fail or corrupt
        inside the receiver)."""
        return self._rl_refit_state().load(named_tensors)

    # --- refit steps ----------------------------------------------------------------------------

    def rl_refit_ready(self) -> dict[str, Any]:
        """Prepare the worker (AMX permission, refit state); returns what it is."""
        refit = self._rl_refit_state()
        return {"rank": int(getattr(self, "rank", 0)), "device": str(refit.device), "pid": os.getpid()}

    def rl_refit_begin(self) -> None:
        with self._rl_refit_context():
            self._rl_refit_state().begin()

    def rl_refit_load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Colocated: one bucket's tensors, by reference (copied before this returns)."""
        with self._rl_refit_context():
            return self._rl_refit_load_named(named_tensors)

    def rl_refit_finalize(self, reset_kv_scales: bool) -> list[Any]:
        with self._rl_refit_context():
            refit = self._rl_refit_state()
            refit.reset_kv_scales = bool(reset_kv_scales)
            stats = refit.finalize()
        return [stats.kv_scales_reset, stats.seconds, stats.tensors_loaded, stats.parameters_written,
                list(stats.unwritten), stats.experts_redone]

    def rl_refit_abort(self) -> None:
        with self._rl_refit_context():
            self._rl_refit_state().abort()

    def rl_refit_delta_base(self) -> list[object]:
        """The worker's delta receiver as [digest, host bytes, seconds] (the first call turns it on)."""
        from adapters.vllm.delta import base_to_plain

        return base_to_plain(self._rl_refit_state().delta_base())

    # --- the side group (disaggregated) --------------------------------------------------------

    def rl_refit_join(self, rendezvous: dict[str, Any], bucket_bytes: int, timeout_s: float) -> int:
        """Join the trainer's side group as rank 1 + this worker's rank; returns that rank.

        Blocks until every member has joined (the trainer constructs its end meanwhile).
        """
        from adapters.distributed.side_group import Rendezvous, SideGroup
        from adapters.distributed.transport import TorchDistTransport

        self.rl_refit_leave()
        rank = 1 + int(getattr(self, "rank", 0))
        group = SideGroup.join(Rendezvous.from_dict(rendezvous), rank)
        self._rl_refit_side: SideGroup | None = group
        self._rl_refit_transport: TorchDistTransport | None = TorchDistTransport(
            group, source=0, rank=rank, peers=group.ranks, bucket_bytes=int(bucket_bytes),
            timeout_s=float(timeout_s), device=group.device,
        )
        log.info("joined the refit side group", rank=rank, world_size=group.rendezvous.world_size,
                 backend=group.rendezvous.backend)
        return rank

    def rl_refit_receive(self, refit_id: int, relearn: bool = False) -> int:
        """Receive one refit's bucket stream from the trainer and load every bucket; returns the
        tensors loaded. Raises what the stream or a load raised (after draining the stream).
        `relearn`: the stream carries its metadata again (its layout may differ: delta refits)."""
        transport = getattr(self, "_rl_refit_transport", None)
        if transport is None:
            from domain.errors import RefitLifecycleError

            raise RefitLifecycleError("receive before join: call rl_refit_join first")
        transport.refit_id = int(refit_id)
        if relearn:
            transport.forget_layout()
        loaded = 0

        def consume(bucket: Bucket) -> None:
            nonlocal loaded
            loaded += self._rl_refit_load_named(list(unpack_bucket(bucket)))

        with self._rl_refit_context():
            transport.receive(consume)
        return loaded

    def rl_refit_leave(self) -> None:
        group = getattr(self, "_rl_refit_side", None)
        if group is not None:
            group.close()
        self._rl_refit_side = None
        self._rl_refit_transport = None

    # --- what the engine holds (plain data) ------------------------------------------------------

    def rl_refit_fingerprint(self) -> list[list[object]]:
        return self._rl_refit_state().fingerprint().to_plain()

    def rl_refit_digests(self) -> dict[str, str]:
        """sha256 of every parameter and buffer (to compare engines bit for bit)."""
        return {n: tensor_digest(t) for n, t in self._rl_refit_state().live_weights().items()}

    def rl_refit_live_weights(self) -> dict[str, list[Any]]:
        """Every parameter and buffer as [dtype, shape, bytes]."""
        out: dict[str, list[Any]] = {}
        for n, t in self._rl_refit_state().live_weights().items():
            t = t.detach().cpu().contiguous()
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            out[n] = [str(t.dtype).removeprefix("torch."), list(t.shape), data]
        return out

    def rl_refit_kv_scales(self) -> dict[str, list[float]]:
        """Each attention layer's q/k/v/prob scale buffers (`_q_scale`, ...), by module name."""
        out: dict[str, list[float]] = {}
        for name, module in self._rl_refit_state().model.named_modules():
            values = [getattr(module, f"_{s}", None) for s in KV_SCALE_NAMES]
            if all(isinstance(v, torch.Tensor) for v in values):
                out[name] = [float(v.item()) for v in values]  # type: ignore[union-attr]
        return out


def tensors_from_plain(plain: dict[str, list[Any]]) -> dict[str, torch.Tensor]:
    """The inverse of `rl_refit_live_weights`."""
    out = {}
    for name, (dtype, shape, data) in plain.items():
        dt = getattr(torch, dtype)
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        out[name] = raw.view(dt).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dt)
    return out
