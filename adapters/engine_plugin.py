"""The engine plugin: everything rl-refit knows about one rollout engine, in one record
(adapters.plugins holds the one table of them; docs/architecture.md#engine-plugins).

A plugin names its profile (support table, layouts, dispatch rules, backend policy, pins), its
`rollout.engine_kwargs.<name>` section, how it is built for each deployment it runs in, how an
engine of it is started cold for comparisons, and what it asks of the process that builds it. The
composition root, `refit doctor`, the demos and the benchmarks ask the plugin; none of them names
an engine. Each plugin's module imports its engine's package only inside the functions that build
one, so reading this table costs no engine import.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from adapters.engine_profile import StaticEngineProfile

if TYPE_CHECKING:
    from adapters.engine_start import EngineStart
    from adapters.reference.config import ReferenceModelConfig
    from domain.quant.plan import QuantizationPlan
    from domain.refit.session import CommitMode
    from ports.rollout_engine import RolloutEngine

COLOCATED, DISAGGREGATED, ATTACHED = "colocated", "disaggregated", "attached"
DEPLOYMENTS = (COLOCATED, DISAGGREGATED, ATTACHED)  # rollout.deployment's values


@attrs.frozen
class EngineHost:
    """What the process that builds an engine offers it, as the composition root read it.

    Attributes:
        environ: this process's environment (a server the plugin starts inherits it).
        honoured: the honoured environment variables that are set (bootstrap.ENV_VARS, each
            plugin's `environment` among them).
        export_environment: sets variables in this process (an engine in this process reads them
            as it starts).
        embedded_model_dir: a directory with the embedded model's config.json (no model.path).
        embedded_config: the embedded model's shapes (reference.model, or model.path's).
        embedded_device: reference.device, where the embedded engine computes.
        bucket_bytes: the refit's bucket size.
        cpus: the cores this process may run on.
    """

    environ: Mapping[str, str]
    honoured: Mapping[str, str]
    export_environment: Callable[[Mapping[str, str]], None]
    embedded_model_dir: Callable[[], Path]
    embedded_config: Callable[[], ReferenceModelConfig]
    embedded_device: str = "cpu"
    bucket_bytes: int = 0
    cpus: tuple[int, ...] = ()


@attrs.frozen
class EngineRequest:
    """One engine to build, as the composition root resolved it.

    Attributes:
        section: the engine's `rollout.engine_kwargs.<name>` section (None: it has none).
        plan: the plan the refits into it send.
        start: what a real engine starts with for that plan (called only by engines that start).
        host: what this process offers it.
        deployment: rollout.deployment, one of the plugin's `deployments`.
        replica: which replica of the deployment (0 for the first).
        commit_mode: rollout.commit_mode (None: the engine's own).
        kv_cache_scheme: the quantization config's kv_cache_scheme (None: uncalibrated).
        sync_backend: rollout.checkpoint_engine.backend.
        wire_format: rollout.wire_format.
        lora_rank: serve LoRA adapters of this rank (`actor.lora.sync: adapter`); None: no LoRA.
    """

    section: Any
    plan: QuantizationPlan
    start: Callable[[], EngineStart]
    host: EngineHost
    deployment: str = COLOCATED
    replica: int = 0
    commit_mode: CommitMode | None = None
    kv_cache_scheme: Mapping[str, object] | None = None
    sync_backend: str = "naive"
    wire_format: str = "bucketed"
    lora_rank: int | None = None


@attrs.frozen
class EngineBaselines:
    """The engine's own ways in, that `refit bench engine` measures a refit against, all in one
    engine started once (app.bench.engine; docs/benchmarks.md).

    Attributes:
        name: how the report names the engine.
        extension: the worker extension the bench starts the engine with; it answers the calls below.
        presets: the presets its CPU build serves, dense and MoE alike (the bench's choices).
        reload: (engine, directory) -> the engine's own reload of the checkpoint in `directory`.
        mode: (engine, mode) -> how the next refits load: `refit` (rl-refit's), `layerwise` (the
            engine's own reload of the buckets, nothing else), `load_weights` (each bucket straight
            into the model's loaders, unprocessed), `receive` (the buckets received and dropped).
        stream: engine -> its workers' bucket steps (`begin()`, `load(bucket)`, `finalize(reset_kv)`)
            without rl-refit's checks around them: the floors send the refit's buckets through it.
        here: what to do when a colocated bench cannot import the engine in this process.
        setup: what to do when the engine's server python cannot import it.
        labels: the report's rows of its baselines: `reload`, `layerwise`, `write_reload`, `load_weights`.
        terms: how the notes name its ways in: `reload`, `layerwise`, `load`, `processing`,
            `loading`, `server`.
        notes: what the notes explain of it: `start_colocated`, `start_disaggregated`, `threads`,
            `load_weights`, `layerwise_differs`, `reload_differs_bf16`, `transport_key`.
    """

    name: str
    extension: str
    presets: tuple[str, ...]
    reload: Callable[[Any, str], None]
    mode: Callable[[Any, str], None]
    stream: Callable[[Any], Any]
    here: str
    setup: str
    labels: Mapping[str, str]
    terms: Mapping[str, str]
    notes: Mapping[str, str]


@attrs.frozen
class InProcessBackup:
    """An engine whose loader backs up what a refit overwrites, served in this process on a model
    shaped like the engine's: what `refit bench refit` measures that backup's host memory on
    (app/bench/loader_backup.py).

    Attributes:
        name: how the report names the engine.
        plans: each row's label -> (rollout.quantization.linear, moe) presets (None: BF16), plans it serves.
        harness: (plan, named weights, head_dim=, hidden=) -> one engine over such a model: its
            `engine` (a RolloutEngine), `updates` (the update calls so far, one per bucket and one
            per marker), `fail_update(index)` (that update fails after the backup),
            `peak_backup_bytes()` and `tensors()` (every parameter and buffer of its model).
        note: what the report says of the model and the loader.
    """

    name: str
    plans: Mapping[str, tuple[str | None, str | None]]
    harness: Callable[..., Any]
    note: str


@attrs.frozen
class WorkerSide:
    """What an engine's own processes import of rl-refit (`refit bench imports` measures it).

    Attributes:
        modules: rl-refit's modules each engine process imports, in order.
        base: the engine's modules they build on (imported first, timed apart: the baseline).
        label: how the baseline is named in the report.
    """

    modules: tuple[str, ...]
    base: tuple[str, ...]
    label: str


@attrs.frozen
class DemoDefaults:
    """What the demos run on an engine that serves them for real (`refit demo <name>`, `refit demo
    qat --engine <name>`, `refit demo lora --engine <name>`, `refit mismatch --engine <name>`):
    what it serves on its CPU build, so that every default runs on the machine the tests run on.

    Attributes:
        section: its section for the demos: (url of a server to attach to, or None; whether the
            model is the user's checkpoint) -> the section.
        preset: the preset `refit demo <name>` refits by default, dense and MoE (None: BF16).
        model: the embedded model the demos start it with by default.
        mismatch_presets: the presets `refit mismatch --engine <name>` scores by default.
        qat_roles: `refit demo qat PRESET --engine <name>`: each preset it serves ->
            (rollout.quantization.linear, moe) (None: BF16 on that role).
        lora_model: the embedded model of `refit demo lora --engine <name>` (None: it has no LoRA demo).
        one_per_process: an engine in this process owns the process's state for the process's
            life: a demo that needs two engines refits both arms into one, in turn.
    """

    section: Callable[[str | None, bool], Any]
    preset: str | None = None
    model: str = "micro-moe"
    mismatch_presets: tuple[str, ...] = ("BF16",)
    qat_roles: Mapping[str, tuple[str | None, str]] = attrs.field(factory=dict)
    lora_model: str | None = None
    one_per_process: bool = False


@attrs.frozen
class EnginePlugin:
    """One rollout engine, as rl-refit knows it (each engine's `adapters/<engine>/engine_plugin.py`).

    Attributes:
        profile: its profile; `profile.name` is rollout.name, `profile.package` what it needs
            installed.
        adapter: its RolloutEngine class, by dotted name (for errors).
        build: builds one engine for an EngineRequest; None for an engine rl-refit only plans for.
        deployments: the `rollout.deployment` values it runs in.
        section: the type of its `rollout.engine_kwargs.<name>` section (None: it has none).
            A section may define `replicas(deployment, configured)`, the number of engines a
            deployment refits (raising ConfigError for one it refuses), and
            `ring_copies_buckets()`, whether its transport copies each tensor out of the
            trainer's memory itself (buckets then travel by reference, unpacked).
        extra: the rl-refit extra that installs `profile.package`.
        cold_start: starts an engine cold from a checkpoint directory, in a process of its own, for
            comparisons: (section, start, host, directory) -> ColdServer. None: it has none.
        environment: the environment variables it honours (the composition root reads them).
        embedded: it computes in this process, in pure torch: the trainer's model can be checked
            against it directly (rollout.verify).
        demo: what the demos run on it as a real engine, each refit against a cold start (None:
            `refit demo <name>` does not exist).
        server_python: the interpreter a server of its own runs with (disaggregated, cold starts):
            (section, host) -> path. None: it starts no server.
        probe: the arguments it adds to `refit doctor`'s environment probe:
            (section, host) -> keyword arguments of adapters.system.probe.SystemProbe.
        worker_side: what its own processes import of rl-refit (None: rl-refit runs in none).
        bench: its own ways in, that `refit bench engine` measures a refit against (a function
            that builds them on first use, so that reading the table imports nothing of them; None:
            the bench does not run on it).
        backup: its loader's backup, measured in this process (a function that builds it on first
            use, so that reading the table imports nothing of it; None: it has none to measure).
    """

    profile: StaticEngineProfile
    adapter: str
    build: Callable[[EngineRequest], RolloutEngine] | None = None
    deployments: frozenset[str] = frozenset({COLOCATED})
    section: type | None = None
    extra: str | None = None
    cold_start: Callable[..., Any] | None = None
    environment: tuple[str, ...] = ()
    embedded: bool = False
    demo: DemoDefaults | None = None
    server_python: Callable[[Any, EngineHost], str] | None = None
    probe: Callable[[Any, EngineHost], Mapping[str, Any]] | None = None
    worker_side: WorkerSide | None = None
    bench: Callable[[], EngineBaselines] | None = None
    backup: Callable[[], InProcessBackup] | None = None

    @property
    def name(self) -> str:
        return self.profile.name

    @property
    def package(self) -> str | None:
        return self.profile.package

    def replicas(self, section: Any, deployment: str, configured: int) -> int:
        """How many engines `deployment` refits (the section's rule, else `configured`)."""
        rule = getattr(section, "replicas", None)
        return configured if rule is None else int(rule(deployment, configured))

    def by_reference(self, section: Any, deployment: str) -> bool:
        """Whether buckets reach this engine by reference (the trainer's tensors, unpacked):
        colocated, or a transport that copies each tensor out itself."""
        copies = getattr(section, "ring_copies_buckets", None)
        return deployment == COLOCATED or (copies is not None and bool(copies()))

    def require(self, key: str) -> None:
        """ModuleNotFoundError naming the adapter and the extra when the engine's package is missing."""
        package = self.package
        if package is None:
            return
        try:
            found = importlib.util.find_spec(package) is not None
        except ModuleNotFoundError:  # a missing parent package
            found = False
        if not found:
            raise ModuleNotFoundError(
                f"{key}={self.name}: {self.adapter} needs {package}, which is not installed; "
                f"install it with pip install 'rl-refit[{self.extra}]'", name=package)
