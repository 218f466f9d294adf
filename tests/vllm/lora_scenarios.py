"""The adapter LoRA mode in a real vLLM engine, one scenario per process (run by
tests/vllm/test_lora_sync.py as `python -m tests.vllm.lora_scenarios SPEC`; prints one JSON line).

Every adapter that goes live is compared with its disk twin: the same adapter written as PEFT
writes it (adapter_model.safetensors, adapter_config.json) and loaded by vLLM itself through its
own `LoRARequest` of that directory, in the same engine, on the same base weights: prompt
log-probs and greedy tokens, bit for bit. Then an update whose staging fails on a worker, and one
whose base refit fails: after each the previous adapter must still equal its twin.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import attrs
import torch
from safetensors.torch import save_file

from adapters.vllm.lora import LoraServing
from app.bootstrap import bootstrap
from app.config_sections import LoraConfig
from app.services.demo_config import engine_config, with_engine_args
from app.services.engine_demo import EngineDemoSettings
from domain.lora.sync import peft_config
from domain.quant.plan import QuantizationPlan
from tests.vllm.extensions import FailLoraStage, FailReceiver, LoraIds

EXTENSION = "tests.vllm.extensions.TestExtension"
TWIN_IDS = 1000  # the disk twins' ids (rl-refit's own count up from 1)


def _preset(name: str | None) -> str | None:
    return None if name in (None, "BF16") else name


@attrs.define
class Twins:
    """Disk twins of the trainer's adapter, each loaded by vLLM from its directory."""

    root: Path
    count: int = 0

    def write(self, adapter: Any) -> LoraServing:
        self.count += 1
        directory = self.root / f"twin-{self.count}"
        directory.mkdir()
        save_file({n: t.contiguous() for n, t in adapter.named_tensors()}, str(directory / "adapter_model.safetensors"))
        (directory / "adapter_config.json").write_text(json.dumps(peft_config(adapter)))
        return LoraServing(f"twin-{self.count}", TWIN_IDS + self.count, str(directory))


def _held(engine: Any) -> list[int]:
    """The adapter ids the engine holds: a server's (rl-refit's `rl-refit-<id>` among what it
    serves), else its worker's."""
    control = getattr(engine.workers, "control", None)
    if control is not None and hasattr(control, "served_loras"):
        return sorted(int(n.rsplit("-", 1)[1]) for n in control.served_loras() if n.startswith("rl-refit-"))
    return list(engine.workers.call(LoraIds()).ids)


def _compare(engine: Any, twin: LoraServing, ids: torch.Tensor, prompts: list[list[int]]) -> dict[str, Any]:
    served, disk = engine.log_probs(ids)[0], engine.log_probs(ids, lora=twin)[0]
    tokens, disk_tokens = engine.greedy(prompts, 6), engine.greedy(prompts, 6, lora=twin)
    engine.workers.lora_drop(twin.adapter_id)  # a twin holds an adapter slot only while compared
    return {"logprobs_equal": bool(torch.equal(served, disk)), "max_abs_diff": float((served - disk).abs().max()),
            "tokens_equal": tokens == disk_tokens, "served": served}


def run(spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    plan = QuantizationPlan.from_presets(_preset(spec.get("linear")), _preset(spec.get("moe")))
    settings = EngineDemoSettings(deployment=spec["deployment"], plan=plan, model=spec.get("model", "micro-dense"))
    cfg = engine_config(settings, 0.25)
    cfg = attrs.evolve(cfg, actor=attrs.evolve(cfg.actor, lora=LoraConfig(rank=spec.get("rank", 8), sync="adapter")))
    # a failed base refit is restored by streaming the previous buckets again (vLLM keeps no copy)
    ce = attrs.evolve(cfg.rollout.checkpoint_engine, restore="replay")
    cfg = attrs.evolve(cfg, rollout=attrs.evolve(cfg.rollout, checkpoint_engine=ce))
    services = bootstrap(with_engine_args(cfg, start_timeout_s=900, worker_extension_cls=EXTENSION))
    try:
        svc = services.lora.sync_service()
    except Exception as err:  # the engine did not start: the test decides whether that may be so
        from adapters.vllm.launcher import root_cause

        text = f"{type(err).__name__}: {err}"
        return {"spec": spec, "not_started": (root_cause(text) or text.splitlines()[0])[:2000]}
    engine: Any = svc.engine
    trainer: Any = svc.trainer
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, trainer.config.vocab_size, (2, 24), generator=g)
    prompts = [ids[0, :8].tolist(), ids[1, :8].tolist()]
    twins = Twins(workdir)
    out: dict[str, Any] = {"spec": spec, "updates": []}
    previous_served = None
    last_twin: LoraServing | None = None
    try:
        for update in (1, 2, 3):
            if update > 1:
                trainer.perturb_(update, 0.05)
            report = svc.sync()
            last_twin = twins.write(trainer.adapter)
            cmp = _compare(engine, last_twin, ids, prompts)
            served = cmp.pop("served")
            out["updates"].append({
                "update": update, "live": report.live, "error": report.error, "base_sent": report.base is not None,
                "bytes_sent": report.bytes_sent, "adapter_bytes": report.adapter_bytes, **cmp,
                "moved": previous_served is None or not torch.equal(served, previous_served),
                "held": _held(engine),
            })
            previous_served = served
        assert last_twin is not None
        good = trainer.snapshot()
        # a worker fails the next staging after it built the adapter
        engine.workers.call_all(FailLoraStage())
        trainer.perturb_(7, 0.05)
        failed = svc.sync()
        trainer.restore_(good)  # the adapter the engine still serves
        cmp = _compare(engine, twins.write(trainer.adapter), ids, prompts)
        cmp.pop("served")
        out["failed_stage"] = {"live": failed.live, "error": failed.error, "adapter_id": failed.adapter_id, **cmp,
                               "held": _held(engine)}
        # the base refit of the same step fails on its second bucket (restored by replay)
        engine.workers.call(FailReceiver(1))
        trainer.perturb_(8, 0.05)
        failed = svc.sync(base_changed=True)
        trainer.restore_(good)
        cmp = _compare(engine, twins.write(trainer.adapter), ids, prompts)
        cmp.pop("served")
        out["failed_base"] = {"live": failed.live, "error": failed.error, "adapter_id": failed.adapter_id,
                              "base_outcome": None if failed.base is None else failed.base.outcome.value,
                              "engine_state": None if failed.base is None else failed.base.engine_state, **cmp,
                              "held": _held(engine)}
        # the next step goes live
        trainer.perturb_(9, 0.05)
        again = svc.sync()
        cmp = _compare(engine, twins.write(trainer.adapter), ids, prompts)
        cmp.pop("served")
        out["recovered"] = {"live": again.live, "error": again.error, "base_sent": again.base is not None, **cmp}
    finally:
        engine.close()
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(args[0])
    with tempfile.TemporaryDirectory(prefix="rl-refit-lora-") as tmp:
        result = run(spec, Path(tmp))
    sys.stdout.write("\n" + json.dumps(result, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
