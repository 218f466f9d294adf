"""`refit demo ENGINE`: the demo's refit loop against a real engine, each refit checked
against a cold start of the same exported checkpoint.

The engine starts with dummy weights and refuses to serve; step 0 is the first refit, steps
1..N first perturb the trainer's weights, and with `back` a last refit returns to step 0's weights.
After each refit that went live the trainer's weights are exported with the plan, an engine is
started cold from that directory (in a process of its own), and the two engines are compared:
prompt log-probs and greedy tokens on a fixed batch, and every parameter and buffer's bytes.
`equals_cold_start` is all three, bit for bit. Cold starts of identical exports are made once.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

import attrs
import torch

from adapters.plugins import DEMO_ENGINES
from app.services.demo import check_steps
from app.services.mismatch_probe import token_batch
from app.services.refit import RefitService
from domain.errors import ConfigError, EngineBusy, EngineStale, RefitFailed
from domain.quant.plan import QuantizationPlan
from domain.refit.report import RefitOutcome, RefitReport
from domain.refit.storage import DigestComparison
from ports.engine_inspection import EngineInspection
from ports.rollout_engine import RolloutEngine

BACK = -1  # the step number of the refit back to step 0's weights


class ColdStart(EngineInspection, Protocol):
    """An engine started cold from an export: inspected, and its prompt log-probs."""

    def log_probs(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def placeholders(self, names: Iterable[str]) -> frozenset[str]:
        """Of these parameter names, those the export carries no tensor for (activation scales a
        weight-only export leaves at the engine's load-time values): the comparison skips them."""
        ...


class InspectedEngine(RolloutEngine, EngineInspection, Protocol):
    """The refitted engine: a RolloutEngine the demo can also inspect."""


@runtime_checkable
class _FaultWrapper(Protocol):
    """An engine wrapped by a fault script (adapters.memory.faulty): how many refits it failed."""

    fired: int


def inspected(engine: RolloutEngine) -> InspectedEngine:
    """`engine` as the demo reads it; ConfigError when it cannot be inspected."""
    if not isinstance(engine, EngineInspection):
        raise ConfigError("rollout.name", f"the engine demo compares engines through their digests, KV scales and "
                                          f"greedy tokens (ports.engine_inspection), which {type(engine).__name__} "
                                          "does not serve: use an engine whose adapter does (docs/engines.md)")
    return cast(InspectedEngine, engine)


class _Exports(Protocol):
    def export_trainer(self, trainer: Any, out: str | Path) -> Path: ...


class _ColdStarts(Protocol):
    def cold_start(self, directory: str | Path) -> ColdStart: ...


class EngineDemoServices(Protocol):
    """The composition root's part of the demo (app.bootstrap.Services)."""

    def refit_service(self, *, inject_fault: str | None = None, fault_after: int = 0) -> RefitService: ...

    @property
    def embedded(self) -> _Exports:
        """Exports of the trainer's current weights (`export_trainer`)."""
        ...

    @property
    def engines(self) -> _ColdStarts:
        """Engines started cold from an export (`cold_start`)."""
        ...


@attrs.frozen
class EngineDemoSettings:
    """What `refit demo ENGINE` runs.

    Attributes:
        engine: the engine's name (rollout.name of a plugin with demo defaults).
        deployment: colocated or disaggregated.
        plan: the rollout quantization plan.
        model: the embedded model preset, or a checkpoint directory (`--model DIR`).
        seed: seed of the weights and the batch.
        steps: training-like steps after the first refit.
        back: a last refit back to step 0's weights.
        inject_fault: a refit fault (`bucket:K`, `begin`, `finalize`, `verify`, `storage`) or None.
        fault_step: the step whose refit the fault hits.
        step_scale: size of each training-like step.
        batch: sequences in the comparison batch.
        seq_len: tokens per sequence (prompt log-probs).
        new_tokens: greedy tokens generated per sequence.
        url: attached: the server the user started (rl-refit starts no engine then).
    """

    engine: str = DEMO_ENGINES[0]  # the first engine whose plugin runs the demo
    deployment: str = "disaggregated"
    plan: QuantizationPlan = attrs.field(factory=lambda: QuantizationPlan.from_presets("FP8_BLOCK", "FP8_BLOCK"))
    model: str = "micro-moe"
    seed: int = 0
    steps: int = 2
    back: bool = True
    inject_fault: str | None = None
    fault_step: int = 1
    step_scale: float = 0.02
    batch: int = 3
    seq_len: int = 16
    new_tokens: int = 8
    url: str | None = None

    def __attrs_post_init__(self) -> None:
        check_steps(self.steps, self.inject_fault, self.fault_step)


@attrs.frozen
class ColdReference:
    """What an engine started cold from one export serves.

    Attributes:
        log_probs, tokens: its prompt log-probs and greedy tokens.
        digests: sha256 of every parameter and buffer.
        placeholders: parameters no load of this export writes, on a cold start or by a refit:
            activation scales of a kind the export has no tensor of (an engine's NVFP4 expert
            method may allocate input scales for weight-only experts, which its W4A16 kernels
            never read; docs/engines.md). Their bytes are whatever the engine allocated, so they are not
            compared.
    """

    log_probs: torch.Tensor
    tokens: list[list[int]]
    digests: dict[str, str]
    placeholders: frozenset[str] = frozenset()


@attrs.frozen
class Served:
    """What an engine serves after a refit (ColdStartComparer.observe): what a cold start is
    compared with.

    Attributes:
        log_probs: its prompt log-probs on the comparison batch.
        tokens: its greedy tokens.
        digests: sha256 of every parameter and buffer, by name.
        kv_scales: attention layers' q/k/v/prob scales, by layer.
    """

    log_probs: torch.Tensor
    tokens: list[list[int]]
    digests: dict[str, str]
    kv_scales: dict[str, list[float]]

    def fingerprint(self) -> str:
        """A short sha256 of all of it: equal fingerprints = the same weights served the same way."""
        h = hashlib.sha256()
        h.update(self.log_probs.contiguous().view(torch.uint8).numpy().tobytes())
        h.update(repr((self.tokens, sorted(self.digests.items()))).encode())
        return h.hexdigest()[:16]


@attrs.frozen
class EngineStep:
    """One refit of the demo and its comparison.

    Attributes:
        step: 0 = first refit, BACK = the refit back to step 0's weights.
        report: the refit's report.
        serving: "yes", or "no (stale)" / "no (busy)" when the engine refused to serve.
        equals_cold_start: log-probs, tokens and weights all equal a cold start (None: not
            compared, the refit did not go live).
        logprobs_equal: prompt log-probs equal bit for bit.
        tokens_equal: greedy tokens equal.
        weights_equal: every parameter and buffer compared is equal bit for bit (None: none could be
            compared); those in `not_compared` and `unreadable` are not.
        max_abs_logp_diff: the largest log-prob difference from the cold start.
        differing_weights: names of the tensors that differ (at most 10).
        kv_scales: attention layers' q/k/v/prob scales after the refit, by layer.
        not_compared: parameters left out of the byte comparison (ColdReference.placeholders).
        unreadable: parameters the engine keeps packed outside their (emptied) tensor, whose bytes
            cannot be read (docs/engines.md: CPU BF16 Linear layers); the log-probs and greedy tokens check
            their computation instead.
    """

    step: int
    report: RefitReport
    serving: str
    equals_cold_start: bool | None = None
    logprobs_equal: bool | None = None
    tokens_equal: bool | None = None
    weights_equal: bool | None = None
    max_abs_logp_diff: float | None = None
    differing_weights: tuple[str, ...] = ()
    kv_scales: dict[str, list[float]] = attrs.field(factory=dict)
    not_compared: tuple[str, ...] = ()
    unreadable: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return "back" if self.step == BACK else str(self.step)

    def comparison(self) -> dict[str, object]:
        """The comparison with the cold start alone (what a world's demo adds to an engine rank's record)."""
        return {"serving": self.serving, "equals_cold_start": self.equals_cold_start,
                "logprobs_equal": self.logprobs_equal, "tokens_equal": self.tokens_equal,
                "weights_equal": self.weights_equal, "max_abs_logp_diff": self.max_abs_logp_diff,
                "differing_weights": list(self.differing_weights), "unreadable": list(self.unreadable)}

    def to_dict(self) -> dict[str, object]:
        return {
            "step": self.label, "refit": self.report.to_dict(), "serving": self.serving,
            "equals_cold_start": self.equals_cold_start, "logprobs_equal": self.logprobs_equal,
            "tokens_equal": self.tokens_equal, "weights_equal": self.weights_equal,
            "max_abs_logp_diff": self.max_abs_logp_diff, "differing_weights": list(self.differing_weights),
            "kv_scales_reset": self.report.kv_scales_reset, "kv_scales": self.kv_scales,
            "not_compared": list(self.not_compared), "unreadable": list(self.unreadable),
        }


@attrs.frozen
class EngineDemoResult:
    settings: EngineDemoSettings
    refused_before_first_refit: bool
    steps: tuple[EngineStep, ...]
    fault_fired: bool | None

    @property
    def ok(self) -> bool:
        """Every live refit equals its cold start, the engine refused before its first refit (an
        engine rl-refit started with dummy weights), and no failed refit left it serving a mix (a stale engine refuses; a rolled-back one serves
        its previous weights)."""
        live = [s for s in self.steps if s.report.ok]
        failed_closed = all(s.serving != "yes" for s in self.steps if s.report.outcome is RefitOutcome.STALE)
        # a server the user started from a checkpoint serves it before any refit: nothing to refuse
        refused = self.refused_before_first_refit or self.settings.url is not None
        return refused and bool(live) and all(s.equals_cold_start for s in live) and failed_closed


def _export_digest(directory: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            h.update(path.relative_to(directory).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def run_engine_demo(settings: EngineDemoSettings, services: EngineDemoServices,
                    on_step: Callable[[EngineStep], None] | None = None, workdir: str | Path | None = None) -> EngineDemoResult:
    """Run the demo.

    Args:
        settings: what to run.
        services: the composition root's (refit service, export, cold starts).
        on_step: called with each EngineStep as soon as it exists.
        workdir: where exports go (default: a temporary directory, removed afterwards).

    Returns:
        The EngineDemoResult.
    """
    svc = services.refit_service(inject_fault=settings.inject_fault, fault_after=settings.fault_step)
    engine = inspected(svc.engine)
    try:
        with tempfile.TemporaryDirectory(prefix="rl-refit-engine-demo-") as tmp:
            return _run(settings, services, svc, engine, Path(workdir) if workdir else Path(tmp), on_step)
    finally:
        engine.close()


def _run(settings: EngineDemoSettings, services: EngineDemoServices, svc: RefitService, engine: InspectedEngine,
         workdir: Path, on_step: Callable[[EngineStep], None] | None) -> EngineDemoResult:
    trainer: Any = svc.trainer
    comparer = ColdStartComparer(services, trainer.config.vocab_size, settings, workdir)
    refused = comparer.refuses(engine)
    start = trainer.snapshot()
    schedule = list(range(settings.steps + 1)) + ([BACK] if settings.back else [])
    steps: list[EngineStep] = []
    for step in schedule:
        if step == BACK:
            trainer.restore_(start)
        elif step:
            trainer.perturb_(settings.seed * 1_000 + step, settings.step_scale)
        try:
            report = svc.refit()
        except RefitFailed as err:
            report = err.report
        record = comparer.compare(engine, trainer, report, step)
        steps.append(record)
        if on_step is not None:
            on_step(record)
    fired = (isinstance(engine, _FaultWrapper) and engine.fired > 0) if settings.inject_fault else None
    return EngineDemoResult(settings, refused, tuple(steps), fired)


@attrs.frozen
class ServedBatch:
    """The fixed batch an engine is read on, the same for the refitted engine and its cold starts.

    Attributes:
        ids: the prompt log-probs' token ids, [batch, seq_len].
        prompts: the greedy prompts (each row's first half, at least 5 tokens: a CPU build may
            need them on its first request, docs/engines.md).
        new_tokens: greedy tokens generated per prompt.
    """

    ids: torch.Tensor
    prompts: list[list[int]]
    new_tokens: int

    @classmethod
    def of(cls, vocab_size: int, settings: EngineDemoSettings) -> ServedBatch:
        """The batch of the demo's settings (their seed, shape and greedy length)."""
        s = settings
        ids = token_batch(vocab_size, s.batch, s.seq_len, s.seed + 20_000)
        return cls(ids, [row[: max(5, s.seq_len // 2)] for row in ids.tolist()], s.new_tokens)

    def observe(self, engine: InspectedEngine) -> Served | str:
        """What the engine serves now (prompt log-probs, greedy tokens, digests, KV scales), or
        why it serves nothing: "no (stale)" or "no (busy)"."""
        try:
            served = engine.log_probs(self.ids)[0]
        except EngineStale:
            return "no (stale)"
        except EngineBusy:
            return "no (busy)"
        return Served(served, engine.greedy(self.prompts, self.new_tokens), engine.digests(), engine.kv_scales())


@attrs.define
class ColdStartComparer:
    """Compares a refitted engine with cold starts of the trainer's exports (each distinct export
    started once).

    Attributes:
        services: exports and cold starts.
        vocab_size: the model's vocabulary (for the fixed batch).
        settings: the batch's shape and seed, the greedy length.
        workdir: where exports go.
        cache_dir: where cold-start results are kept across runs, by export digest (None: in
            memory only). A cold start is deterministic in its export, so runs that export the
            same weights (e.g. two deployment shapes) share one.
    """

    services: EngineDemoServices
    vocab_size: int
    settings: EngineDemoSettings
    workdir: Path
    cache_dir: Path | None = None
    batch: ServedBatch = attrs.field(init=False)
    _cold: dict[str, ColdReference] = attrs.field(init=False, factory=dict)
    _exports: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self.batch = ServedBatch.of(self.vocab_size, self.settings)

    @property
    def ids(self) -> torch.Tensor:
        return self.batch.ids

    @property
    def prompts(self) -> list[list[int]]:
        return self.batch.prompts

    def refuses(self, engine: RolloutEngine) -> bool:
        """The engine refuses to serve (EngineStale)."""
        try:
            engine.log_probs(self.ids)
        except EngineStale:
            return True
        return False

    def reference(self, trainer: Any) -> ColdReference:
        """What a cold start of the trainer's current export serves."""
        out = self.workdir / f"export-{self._exports}"
        self._exports += 1
        self.services.embedded.export_trainer(trainer, out)
        key = _export_digest(out)
        if key not in self._cold:
            self._cold[key] = self._load(key) or self._start_cold(out, key)
        return self._cold[key]

    def _start_cold(self, out: Path, key: str) -> ColdReference:
        cold = self.services.engines.cold_start(out)
        try:
            digests = cold.digests()
            ref = ColdReference(cold.log_probs(self.ids), cold.greedy(self.prompts, self.settings.new_tokens), digests,
                                cold.placeholders(digests))
        finally:
            cold.close()
        if self.cache_dir is not None:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = self.cache_dir / f".{key}.{os.getpid()}.pt"
            torch.save({"log_probs": ref.log_probs, "tokens": ref.tokens, "digests": ref.digests,
                        "placeholders": sorted(ref.placeholders)}, tmp)
            tmp.replace(self.cache_dir / f"{key}.pt")  # atomic: a reader sees all of it or nothing
        return ref

    def _load(self, key: str) -> ColdReference | None:
        path = None if self.cache_dir is None else self.cache_dir / f"{key}.pt"
        if path is None or not path.exists():
            return None
        data = torch.load(path, weights_only=True)
        return ColdReference(data["log_probs"], data["tokens"], data["digests"], frozenset(data.get("placeholders", ())))

    def compare(self, engine: InspectedEngine, trainer: Any, report: RefitReport, step: int) -> EngineStep:
        """The engine (after `report`'s refit) against a cold start of the trainer's weights."""
        return self.against(self.batch.observe(engine), trainer, report, step)

    def against(self, seen: Served | str, trainer: Any, report: RefitReport, step: int) -> EngineStep:
        """What an engine served after `report`'s refit (ServedBatch.observe), against a cold start of the
        trainer's current weights (none is made for a refit that did not go live)."""
        if isinstance(seen, str):
            return EngineStep(step, report, seen)
        if not report.ok:  # served although the refit failed: report it, compare nothing
            return EngineStep(step, report, "yes", kv_scales=seen.kv_scales)
        ref = self.reference(trainer)
        served = seen.log_probs
        same_shape = served.shape == ref.log_probs.shape
        logprobs_equal = same_shape and torch.equal(served, ref.log_probs)
        diff = float((served.double() - ref.log_probs.double()).abs().max()) if same_shape else float("inf")
        weights = DigestComparison.of(ref.digests, seen.digests, skip=frozenset(ref.placeholders))
        differing = weights.differing
        tokens_equal = seen.tokens == ref.tokens
        return EngineStep(step, report, "yes", logprobs_equal and tokens_equal and not differing, logprobs_equal,
                          tokens_equal, weights.same, diff, differing[:10], seen.kv_scales,
                          tuple(sorted(ref.placeholders)), weights.unreadable)
