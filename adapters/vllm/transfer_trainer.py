"""rl-refit as a vLLM weight-transfer backend, trainer side: code written against vLLM's own
clients (TRL, SkyRL) selects rl-refit by name.

    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory
    from adapters.vllm.transfer_trainer import RlRefitTrainerInitInfo

    client = HTTPVLLMWeightSyncClient("http://127.0.0.1:8000")
    sender = WeightTransferTrainerFactory.trainer_init(
        RlRefitTrainerInitInfo(rank=0, workers=1, linear="FP8_BLOCK"), client=client, source=ModuleSource(model))
    sender.send_weights()  # start, stream, finish: the server now serves the model's weights

Importing this module registers `RlRefitTrainerEngine` as `rl_refit` in vLLM's trainer-side factory.
Each `send_weights` quantizes the source's weights into the rollout's layout (the plan named by
`linear` / `moe`; none: BF16 as given), streams them in buckets through rl-refit's shared-memory
ring to the server's workers (which must run on this host) and finishes the update. A refit that
fails anywhere leaves the server on its previous weights (the workers restore them) and raises the
worker's typed error when the server's workers could be asked for it.

This path is vLLM's: it does not pause generation (the caller does, as TRL does with `/pause`),
and it runs no post-refit probe. rl-refit's own path (`rollout.deployment: attached`,
adapters.vllm.attached) does both.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

import attrs
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from adapters.vllm.session import BACKEND, InitInfo, rl_refit_version
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import quantize_stream
from domain.refit.buckets import BucketPlanner


@dataclass
class RlRefitTrainerInitInfo(TrainerInitInfo):
    """The trainer side's init info (`rank` is keyword-only, from vLLM's base).

    Attributes:
        workers: the server's workers (tensor x pipeline parallel size): the ring waits for each.
        linear: the preset dense layers are served in (FP8_BLOCK, MXFP8, MXFP4, NVFP4), or None.
        moe: the preset routed experts are served in, or None.
        bucket_bytes: bucket capacity.
        timeout_s: bound on joining and on every wait of a stream.
        slot_bytes: bytes of each of the ring's slots.
    """

    backend: ClassVar[str] = BACKEND

    workers: int = 1
    linear: str | None = None
    moe: str | None = None
    bucket_bytes: int = 512 << 20
    timeout_s: float = 120.0
    slot_bytes: int = 32 << 20


class RlRefitTrainerEngine(TrainerWeightTransferEngine[RlRefitTrainerInitInfo]):
    """The rl_refit backend's trainer side (see the module's docstring)."""

    init_info_cls = RlRefitTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True,
                 info: RlRefitTrainerInitInfo | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info = info or RlRefitTrainerInitInfo(rank=0)
        self.plan = QuantizationPlan.from_presets(self.info.linear, self.info.moe)
        self.token = secrets.token_hex(16)
        self.sender: Any = None
        self.rounds = 0

    @classmethod
    def trainer_init(cls, init_info: RlRefitTrainerInitInfo, *, client: Any, source: Any = None) -> RlRefitTrainerEngine:
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
        if engine.is_sender:
            engine._rendezvous()
        return engine

    def _rendezvous(self) -> None:
        from adapters.distributed.shm_transport import ShmSource

        info = self.info
        source = ShmSource.serve(info.workers, slot_bytes=min(info.bucket_bytes, info.slot_bytes),
                                 timeout_s=info.timeout_s)
        try:
            worker_info = InitInfo(self.token, rl_refit_version(), "shm", source.rendezvous.to_dict(),
                                   info.bucket_bytes, info.timeout_s)
            self.client.init_weight_transfer_engine(attrs.asdict(worker_info))
        except BaseException:
            source.close()
            raise
        self.sender = source.accept()

    def send_weights(self, weight_version: str | None = None) -> None:
        """One refit: start, stream the source's weights (in the plan's layout), finish."""
        if not self.is_sender:
            for _ in self.source or ():  # the source's collectives stay aligned across ranks
                pass
            return
        if self.source is None:
            raise ValueError("RlRefitTrainerEngine.send_weights needs the WeightSource given to trainer_init")
        self.rounds += 1
        self.client.start_weight_update()
        self.sender.refit_id = self.rounds
        failure: list[BaseException] = []

        def update() -> None:
            try:
                self.client.update_weights({"token": self.token, "refit_id": self.rounds})
            except BaseException as err:
                failure.append(err)

        thread = threading.Thread(target=update, name="rl-refit-update-weights", daemon=True)
        thread.start()
        planner = BucketPlanner(self.info.bucket_bytes, by_reference=True)
        try:
            self.sender.send(planner.pack(quantize_stream(self.plan, iter(self.source))))
        finally:
            thread.join(self.info.timeout_s + 30.0)
        if failure:
            raise failure[0]
        self.client.finish_weight_update(weight_version or f"rl-refit-{self.rounds}")

    def shutdown(self) -> None:
        sender, self.sender = self.sender, None
        if sender is not None:
            sender.close()


def register() -> None:
    """`rl_refit` in vLLM's trainer-side factory (idempotent)."""
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, RlRefitTrainerEngine)


register()
