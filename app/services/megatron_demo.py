"""`refit demo megatron`: a real Megatron-Core trainer, sharded tp x pp x ep over
processes, trains a few steps and refits the engine after every step.

The world: trainer ranks 0..N-1 run Megatron (its parallel_state over exactly those ranks), engine
ranks N.. run the reference engine of the same architecture. Each step, every trainer rank does one
SGD step on the same batch (one batch for every step: the loss falls as the model learns it)
(`MegatronDemoKit.train_step`), then the world runs two distributed refits, the plan's arm and a
BF16 arm (each its own DistributedRefitService, built by the composition root from this rank's
model), and every engine scores a probe batch. The trainer ranks also hand back their current
weights as Megatron's own checkpoint metadata describes them.

Every step is judged against the trainer's own weights, gathered into one process: in a process
of its own, `unsharded_rank` loads every trainer rank's pieces into the unsharded (tp = pp = ep =
1) model and exports it; `judge` refits that export in one process into a fresh reference engine
per arm. Three checks:
- "sharded = unsharded": the engine of the sharded refit holds exactly that engine's weights;
- BF16 exactness: the engine's log-probs of the probe equal, bit for bit, those of the forward it
  is defined against, the reference engine's, on the unsharded BF16 weights (k3 KL = 0 exactly);
- Megatron's own forward of the unsharded model against the engine's: two implementations of one
  model (float32 against BF16 compute), close, not bit-identical. Its k3 KL on the BF16 arm is
  reported and must stay within `MEGATRON_K3_BOUND`.

On a real engine (`MegatronDemoSettings.served`), each engine rank refits a server it started and
reads what it serves after every refit; `judge_cold_starts` compares that with a cold start of
the unsharded model's export, bit for bit, instead of the three checks above.
"""

from __future__ import annotations

import contextlib
import io
import math
import pickle
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from app.services.distributed_demo import weights_digest
from app.services.mismatch_probe import response_mask, token_batch
from domain.errors import CollectiveTimeout, DistributedRefitFailed, PeerLost
from domain.mismatch import mismatch_metrics
from domain.quant.plan import QuantizationPlan
from domain.refit.topology import RefitWorld

if TYPE_CHECKING:
    from app.bootstrap import Services
    from app.services.engine_demo import ColdStartComparer, ServedBatch

BF16 = "BF16"
# The bound on the BF16 arm's k3 KL between Megatron's forward and the engine's, measured on this
# demo's models (docs/megatron-sharded.md): the figure is the BF16 compute of the engine against
# Megatron's float32 compute, 6e-5 .. 4.9e-4 over 160 runs of tiny-moe (seeds, steps 0-3; MoE
# routing flips dominate), at most 4e-5 for micro-moe and 7e-6 for the dense models. Changing the
# BF16 matmul kernel (AVX-512 BF16, AMX, or float32 accumulation with one rounding) moves it by at
# most 1.5e-5. 2e-3 is 4x the largest measurement; a refit one step behind gives 2.9e-2.
MEGATRON_K3_BOUND = 2e-3
# The engine ranks' torch threads (launch_world's default): the reference forward is scored with
# the same, so that "bit for bit" compares one kernel with itself.
ENGINE_THREADS = 1


@attrs.frozen
class MegatronDemoSettings:
    """What `refit demo megatron` runs.

    Attributes:
        plan: the rollout plan under test (a BF16 arm runs beside it).
        plan_name: its label.
        steps: training steps after the initial sync.
        lr: the SGD learning rate.
        seed: seed of the training and probe batches.
        batch: sequences per batch.
        seq_len: tokens per sequence.
        prompt_len: probe tokens that are prompt (the rest is the scored response).
        step_timeout_s: bound on every per-bucket and tensor-parallel wait.
        phase_timeout_s: bound on every agreement.
        served: on a real engine (`--engine vllm`), the batch each engine rank reads what its
            engine serves on after every refit (app.services.engine_demo); the plan's arm alone
            runs, each refit judged against a cold start (`judge_cold_starts`). None: the
            reference engine, both arms.
    """

    plan: QuantizationPlan
    plan_name: str
    steps: int = 3
    lr: float = 0.1
    seed: int = 0
    batch: int = 4
    seq_len: int = 32
    prompt_len: int = 8
    step_timeout_s: float = 20.0
    phase_timeout_s: float = 60.0
    served: ServedBatch | None = None

    def arms(self) -> dict[str, QuantizationPlan]:
        if self.served is not None:  # one engine per arm: a real engine runs the plan's alone
            return {self.plan_name: self.plan}
        return {self.plan_name: self.plan, BF16: QuantizationPlan.bf16()}


def _pack(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t.detach().clone(), buf)
    return buf.getvalue()


def _unpack(data: bytes) -> torch.Tensor:
    return torch.load(io.BytesIO(data))


def _pickled(value: object) -> bytes:
    """`value` by value: a tensor put on the world's result queue as it is would travel as a
    shared-memory handle, which ends with the rank's process."""
    return pickle.dumps(value)


def demo_rank(rank: int, services: Services, settings: MegatronDemoSettings, world: RefitWorld) -> list[dict[str, Any]]:
    """One process of the world: every step's training and refits on this rank.

    Returns:
        One record per step: the loss (last stage), per arm the outcome and, on engines, the live
        weights' digest and the probe's log-probs; on trainer ranks Megatron's pieces.
    """
    kit = services.embedded.megatron_demo_kit()
    vocab = services.embedded.reference_config().vocab_size
    probe = probe_batch(services, settings)
    # One batch, trained on at every step: the loss falls as the model learns it.
    tokens = token_batch(vocab, settings.batch, settings.seq_len + 1, settings.seed * 1_000 + 1)
    records = []
    with kit.parallel(world.layout, rank) as model:
        refits = {
            name: services.world.distributed_refit(world, rank, plan=plan, model=model, step_timeout_s=settings.step_timeout_s,
                                             phase_timeout_s=settings.phase_timeout_s)
            for name, plan in settings.arms().items()
        }
        try:
            for step in range(settings.steps + 1):
                loss = None
                if step and model is not None:
                    loss = kit.train_step(model, tokens, settings.lr)
                record: dict[str, Any] = {"step": step, "rank": rank, "role": world.role(rank).value, "loss": loss,
                                          "arms": {}}
                for name, svc in refits.items():
                    record["arms"][name] = _refit(svc, probe, settings.served)
                if model is not None:
                    record["pieces"] = kit.pieces(model)
                records.append(record)
                if any(svc.broken is not None for svc in refits.values()):
                    break  # a timeout broke the world: no more refits
        finally:
            if settings.served is not None:
                from app.services.engine_demo import inspected

                for svc in refits.values():
                    if svc.engine is not None:
                        inspected(svc.engine).close()  # stops the server this rank started
    return records


def _refit(svc: Any, probe: torch.Tensor, served: ServedBatch | None) -> dict[str, Any]:
    try:
        report, error = svc.refit(), None
    except (DistributedRefitFailed, CollectiveTimeout, PeerLost) as err:
        report, error = err.report, str(err)
    out: dict[str, Any] = {
        "outcome": report.outcome.value if report else "-", "error": error,
        "ms": report.timings["total"] * 1e3 if report else 0.0, "mb": report.bytes_sent / 2**20 if report else 0.0,
        "buckets": report.buckets if report else 0,
    }
    if svc.engine is not None and served is not None:  # a real engine: what it serves, judged against a cold start
        seen = served.observe(svc.engine)
        out["digest"] = seen if isinstance(seen, str) else seen.fingerprint()
        if report is not None and report.ok:
            out["served"], out["report"] = _pickled(seen), report
    elif svc.engine is not None:
        out["digest"] = weights_digest(dict(svc.engine.live_weights()))
        if report is not None and report.ok:
            out["logp"] = _pack(svc.engine.log_probs(probe)[0])
    return out


@attrs.define
class _Unsharded:
    """The unsharded export of one step, as the single-process refit reads a trainer (its
    weights; it is scored through the BF16 reference engine refit from them)."""

    weights: Mapping[str, torch.Tensor]

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.weights.items()


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def probe_batch(services: Services, settings: MegatronDemoSettings) -> torch.Tensor:
    """The tokens every engine, and Megatron's own forward, score."""
    return token_batch(services.embedded.reference_config().vocab_size, settings.batch, settings.seq_len, settings.seed + 7)


def step_pieces(records: Sequence[dict[str, Any]]) -> dict[int, list[Any]]:
    """Every trainer rank's Megatron pieces, by step."""
    out: dict[int, list[Any]] = {}
    for r in sorted(records, key=lambda r: (r["step"], r["rank"])):
        if r["role"] == "trainer":
            out.setdefault(r["step"], []).extend(r["pieces"])
    return out


def unsharded_rank(rank: int, services: Services, pieces: Mapping[int, list[Any]],
                   probe: torch.Tensor) -> dict[int, tuple[dict[str, bytes], bytes]]:
    """A world of one process: each step's unsharded model from every trainer rank's pieces, its
    BF16 export and Megatron's own log-probs of `probe` (a process of its own: the command's
    process never initializes torch.distributed or Megatron, so later worlds start clean)."""
    kit = services.embedded.megatron_demo_kit()
    out = {}
    for step, parts in pieces.items():
        weights, logp = kit.unsharded(parts, probe)
        out[step] = ({n: _pack(t) for n, t in weights.items()}, _pack(logp))
    return out


def _by_step(records: Sequence[dict[str, Any]]) -> list[tuple[int, list[dict[str, Any]]]]:
    """Every rank's records, by step (in order), each step's by rank."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_step.setdefault(r["step"], []).append(r)
    return [(step, sorted(by_step[step], key=lambda r: r["rank"])) for step in sorted(by_step)]


def judge(services: Services, settings: MegatronDemoSettings, world: RefitWorld,
          records: Sequence[dict[str, Any]], unsharded: Mapping[int, tuple[dict[str, bytes], bytes]]) -> list[dict[str, Any]]:
    """Every step's verdict, against the unsharded model of the same global weights.

    Args:
        services: the composition root's services (the demo's configuration).
        settings: the demo's settings.
        world: the refit world the records come from.
        records: every rank's records.
        unsharded: `unsharded_rank`'s result for `step_pieces(records)`.

    Returns:
        One row per step and arm: outcome, `sharded_equals_unsharded` for every engine, the
        mismatch metrics (`k3_kl`, `mean_abs_logp_diff`, ...) of the engine against the reference
        engine's forward on the unsharded weights (BF16: 0 exactly), and Megatron's own forward
        against the same engine (`megatron_k3_kl`; BF16: within `MEGATRON_K3_BOUND`).
    """
    probe = probe_batch(services, settings)
    mask = response_mask(settings.batch, settings.seq_len, settings.prompt_len)
    rows = []
    for step, recs in _by_step(records):
        trainers = [r for r in recs if r["role"] == "trainer"]
        engines = [r for r in recs if r["role"] == "engine"]
        packed, packed_logp = unsharded[step]
        weights, megatron_logp = {n: _unpack(b) for n, b in packed.items()}, _unpack(packed_logp)
        references = {}
        for name, plan in settings.arms().items():
            svc = services.refit_service(plan=plan, trainer=_Unsharded(weights))  # type: ignore[arg-type]
            svc.refit()
            with _threads(ENGINE_THREADS):
                references[name] = (weights_digest(dict(svc.engine.live_weights())), svc.engine.log_probs(probe)[0])
        trainer_logp = references[BF16][1]  # the trainer's weights, scored by the engine's forward
        loss = next((r["loss"] for r in trainers if r["loss"] is not None), None)
        for name in settings.arms():
            outcomes = {r["arms"][name]["outcome"] for r in recs}
            row: dict[str, Any] = {
                "step": step, "arm": name, "loss": loss, "outcome": outcomes.pop() if len(outcomes) == 1 else "mixed",
                "errors": sorted({r["arms"][name]["error"] for r in recs if r["arms"][name]["error"]}),
                "sharded_equals_unsharded": all(e["arms"][name]["digest"] == references[name][0] for e in engines),
                "mb_sent": sum(r["arms"][name]["mb"] for r in trainers),
                "refit_ms": max(r["arms"][name]["ms"] for r in recs),
            }
            logps = [_unpack(e["arms"][name]["logp"]) for e in engines if "logp" in e["arms"][name]]
            if logps:
                row.update(mismatch_metrics(trainer_logp, logps[0], mask).to_dict())
                row["megatron_k3_kl"] = mismatch_metrics(megatron_logp, logps[0], mask).k3_kl
            rows.append(row)
    return rows


def verdict(rows: Sequence[dict[str, Any]]) -> dict[str, bool]:
    """The demo's checks over `judge`'s rows: every refit live, every engine equal to the
    unsharded refit, BF16's k3 KL exactly 0, and Megatron's forward within `MEGATRON_K3_BOUND`
    of the engine's on the BF16 arm."""
    bf16 = [r for r in rows if r["arm"] == BF16]
    return {
        "every_refit_live": all(r["outcome"] == "live" for r in rows),
        "sharded_equals_unsharded": all(r["sharded_equals_unsharded"] for r in rows),
        "bf16_k3_kl_exactly_zero": all(r.get("k3_kl") == 0.0 for r in bf16),
        "megatron_k3_kl_within_bound": all(r.get("megatron_k3_kl", math.inf) <= MEGATRON_K3_BOUND for r in bf16),
    }


def judge_cold_starts(comparer: ColdStartComparer, settings: MegatronDemoSettings, records: Sequence[dict[str, Any]],
                      unsharded: Mapping[int, tuple[dict[str, bytes], bytes]]) -> list[dict[str, Any]]:
    """On a real engine: every step's verdict against a cold start of the unsharded model's export
    (the trainer's own weights, gathered as `judge` gathers them), one cold start per distinct
    export (`comparer`: app.services.engine_demo.ColdStartComparer).

    Returns:
        One row per step (the plan's arm): outcome, errors, `equals_cold_start` for every engine
        (log-probs, greedy tokens and every digest equal, bit for bit), and each engine's
        comparison (`engines`: `logprobs_equal`, `tokens_equal`, `weights_equal`,
        `max_abs_logp_diff`, `differing_weights`, `unreadable`).
    """
    name = settings.plan_name
    rows = []
    for step, recs in _by_step(records):
        outcomes = {r["arms"][name]["outcome"] for r in recs}
        weights = {n: _unpack(b) for n, b in unsharded[step][0].items()}
        engines = []
        for e in (r for r in recs if r["role"] == "engine"):
            arm = e["arms"][name]
            if "served" not in arm:  # the refit did not go live: nothing to compare
                engines.append({"rank": e["rank"], "equals_cold_start": None})
                continue
            compared = comparer.against(pickle.loads(arm["served"]), _Unsharded(weights), arm["report"], step)
            engines.append({"rank": e["rank"], **compared.comparison()})
        rows.append({
            "step": step, "arm": name, "loss": next((r["loss"] for r in recs if r["loss"] is not None), None),
            "outcome": outcomes.pop() if len(outcomes) == 1 else "mixed",
            "errors": sorted({r["arms"][name]["error"] for r in recs if r["arms"][name]["error"]}),
            "equals_cold_start": bool(engines) and all(e["equals_cold_start"] is True for e in engines),
            "max_abs_logp_diff": max((e.get("max_abs_logp_diff") or 0.0 for e in engines), default=None),
            "mb_sent": sum(r["arms"][name]["mb"] for r in recs if r["role"] == "trainer"),
            "refit_ms": max(r["arms"][name]["ms"] for r in recs), "engines": engines,
        })
    return rows


def cold_start_verdict(rows: Sequence[dict[str, Any]]) -> dict[str, bool]:
    """The demo's checks on a real engine over `judge_cold_starts`'s rows: every refit live, and
    every engine equal to a cold start of the unsharded model's export after every refit."""
    return {
        "every_refit_live": all(r["outcome"] == "live" for r in rows),
        "equals_cold_start": all(r["equals_cold_start"] for r in rows),
    }
