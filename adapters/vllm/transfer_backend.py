"""rl-refit as a vLLM weight-transfer backend, worker side: `--weight-transfer-config
'{"backend": "rl_refit"}'`.

vLLM builds one `RlRefitTransferEngine` per worker when the server starts with that config (the
backend is registered in each vLLM process by rl-refit's `vllm.general_plugins` entry point,
adapters.vllm.plugin). vLLM's own control plane then drives it: the HTTP routes
`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`, `/finish_weight_update`
(dev mode), the same methods of an `AsyncLLM` or an offline `LLM`, or a Ray actor's. Everything it
does is the worker's `WorkerSession` (adapters.vllm.session): the transaction with its backup,
the bucket stream from rl-refit's own transport, finalize and the restore.

What vLLM's routes answer is a fixed string; the finalize report, the unwritten parameters and a
failure's typed error are read through rl-refit's worker extension (`rl_refit_report`), which
reaches the same session.

vllm is imported at module level: only vLLM's processes import this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from adapters.vllm.hooks import VllmHooks
from adapters.vllm.session import InitInfo, UpdateInfo, WorkerSession
from adapters.vllm.worker import WorkerRefit


@dataclass
class RlRefitInitInfo(WeightTransferInitInfo):
    """init_info of the rl_refit backend, as vLLM parses it (adapters.vllm.session.InitInfo's fields)."""

    token: str
    version: str
    transport: str
    rendezvous: dict[str, Any]
    bucket_bytes: int
    timeout_s: float = 120.0
    backup: bool = True


@dataclass
class RlRefitUpdateInfo(WeightTransferUpdateInfo):
    """update_info of the rl_refit backend: the session token and the refit's id."""

    token: str
    refit_id: int
    relearn: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def worker_rank() -> int:
    """This worker's rank in vLLM's default group (0 without one)."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class RlRefitTransferEngine(WeightTransferEngine[RlRefitInitInfo, RlRefitUpdateInfo]):
    """The rl_refit weight-transfer engine of one vLLM worker (see the module's docstring)."""

    init_info_cls = RlRefitInitInfo
    update_info_cls = RlRefitUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        from adapters.distributed.receiving import receive_buffer
        from adapters.vllm.extension import request_amx_permission

        request_amx_permission()
        refit = WorkerRefit(model=model, model_config=vllm_config.model_config, hooks=VllmHooks.from_vllm(),
                            device=device)
        load = vllm_config.load_config.load_format
        from_disk = None if str(getattr(load, "value", load)) == "dummy" else self._reload_from_disk
        self.session = WorkerSession(refit, rank=1 + worker_rank(), reload_from_disk=from_disk,
                                     allocate=receive_buffer if device.type == "cpu" else None)

    def _reload_from_disk(self) -> None:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        reload_weights(self.vllm_config, self.model, weights_iterator=None, weights_path=None,
                       is_checkpoint_format=True)

    def init_transfer_engine(self, init_info: RlRefitInitInfo) -> None:
        fields = {k: getattr(init_info, k) for k in
                  ("token", "version", "transport", "rendezvous", "bucket_bytes", "timeout_s", "backup")}
        with self._context():
            self.session.init(InitInfo.of(fields))

    def start_weight_update(self) -> None:
        with self._context():
            self.session.start()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base synchronizes the accelerator after each update; the session's loads are
        # synchronous, and a CPU worker has no accelerator to synchronize
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: RlRefitUpdateInfo) -> None:
        with self._context():
            self.session.update(UpdateInfo(update_info.token, update_info.refit_id, update_info.relearn))

    def finish_weight_update(self) -> None:
        with self._context():
            self.session.finish()

    def shutdown(self) -> None:
        self.session.leave()

    def _context(self) -> Any:
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(self.vllm_config)

