"""The typed configuration: frozen attrs sections, one per level of the verl-style key tree.

`app.config.load_config` parses and validates a file, a dict or dotted overrides once and returns
a `RefitConfig`; Python callers (the CLI, the benchmarks) build the same sections directly, e.g.
`RefitConfig(rollout=RolloutConfig(deployment="attached"))`, and change them with `attrs.evolve`. Every
key is declared here, once, as its section's field (`setting`: types, default, allowed values,
check, its line of docs/configuration.md); SCHEMA and KEYS are derived from these declarations.
The field's converter runs the key's check, so a value set in Python is validated, normalized and
named in errors exactly as one read from YAML (`rollout.quantization.linear=fp8_block` and
`QuantizationConfig(linear="fp8_block")` both hold "FP8_BLOCK").
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from adapters.engine_plugin import DEPLOYMENTS
from adapters.plugins import PLUGINS, SECTIONS
from adapters.profiles import ENGINES
from domain.errors import ConfigError
from domain.forward.mode import parse_fused_forward_mode
from domain.quant import naming
from domain.quant.formats import FORMATS, ActivationScheme, ElementRule, MxScaleRule
from domain.quant.qat_modes import canonical_qat_mode
from domain.quant.rules import DELTA_BACKENDS, DELTA_WIRE_FORMATS, LAYOUT_DELTA_BACKEND
from domain.settings import (
    Key,
    NoneType,
    _at_least,
    _bucket_mib,
    _commit_mode,
    _non_negative,
    _optional_non_negative,
    _positive,
    _positive_or_none,
    _short,
    _torch_device,
    declare,
    section_of,
    setting,
)

SYNC_BACKENDS = ("naive", "nccl", "gloo", LAYOUT_DELTA_BACKEND, *DELTA_BACKENDS)
WIRE_FORMATS = ("bucketed", *DELTA_WIRE_FORMATS)


# The checks of keys that name the domain's values (presets, activation schemes, QAT modes, ...).
def _preset(key: str, value: Any) -> Any:
    if value is None:
        return None
    name = str(value).strip().upper().replace("-", "_")
    if name not in FORMATS:
        raise ConfigError(key, f"unknown precision preset {_short(value)}; valid: {', '.join(FORMATS)} (or null for BF16)")
    return None if name == "BF16" else name


def _activation(key: str, value: Any) -> Any:
    if value is None:
        return None
    valid = [a.value for a in ActivationScheme]
    if str(value).lower() not in valid:
        raise ConfigError(key, f"unknown activation scheme {_short(value)}; valid: {', '.join(valid)} (or null for the default)")
    return str(value).lower()


def _patterns(key: str, value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else list(value)
    for item in items:
        problem = naming.validate_ignore_entry(item)
        if problem:
            raise ConfigError(key, f"{problem} (entry {_short(item)})")
    return tuple(items)


def _qat_mode(key: str, value: Any) -> Any:
    if value is None:
        return None
    canonical_qat_mode(value, key)  # validates; the value is kept as written, for messages
    return str(value).strip()


def _fused_forward(key: str, value: Any) -> Any:
    parse_fused_forward_mode(value, key=key)  # validates; the value is kept as written (bootstrap reads it)
    return value


def _names(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(items)


@attrs.frozen(kw_only=True)
class QuantizationConfig:
    """rollout.quantization: what the rollout is served in (docs/configuration.md#keys)."""

    linear: str | None = setting(
        (str, NoneType), None,
        "preset for dense Linear layers (FP8_BLOCK, MXFP8, MXFP4, NVFP4); null (or BF16) = not quantized",
        check=_preset)
    moe: str | None = setting(
        (str, NoneType), None,
        "preset for routed experts; null = BF16",
        check=_preset)
    moe_activation: str | None = setting(
        (str, NoneType), None,
        "experts' activation scheme; null = the preset's default (see below)",
        check=_activation)
    linear_activation: str | None = setting(
        (str, NoneType), None,
        "dense layers' activation scheme; null = the preset's default",
        check=_activation)
    ignore: tuple[str, ...] = setting(
        (list, tuple, str), (),
        "modules kept BF16, added to the defaults: exact names, dot suffixes, `re:REGEX`, fnmatch "
        "patterns",
        check=_patterns)
    config_file: str | None = setting(
        (str, NoneType), None,
        "a compressed-tensors `quantization_config` JSON (or a `config.json` holding one) used instead of "
        "`linear`/`moe`; the engine receives it as written (see below)")
    allow_config_rewrite: bool = setting(
        (bool,), False,
        "`true`: a `config_file` or `hf_overrides` quantization_config that cannot be honoured as written "
        "is rewritten from the presets, every change listed by `refit plan`, instead of rejected "
        "(`ConfigNotHonoured`)")
    numerics: str = setting(
        (str,), ElementRule.ENGINE.value,
        "element rule (see [formats](formats.md#element-rules)): `engine` (the operation order of the "
        "engine's own quantizers and of the QAT kernels; what the rollout computes) or "
        "`compressed-tensors` (byte-compatible with llm-compressor checkpoints); applies to weights and "
        "activations",
        choices=tuple(r.value for r in ElementRule))
    scale_rule: str | None = setting(
        (str, NoneType), None,
        "MX shared-exponent rule for both MX formats: `rceil` or `even`; null = the element rule's choice "
        "(`engine`: MXFP8 `rceil`, MXFP4 `even`, as the engines' own quantizers; `compressed-tensors`: `even`)",
        choices=(None, *(r.value for r in MxScaleRule)))


def _engine_sections() -> dict[str, Any]:
    return {name: attrs.field(factory=section) for name, section in SECTIONS.items()}


@attrs.frozen(kw_only=True, these=_engine_sections())
class EngineKwargsConfig:
    """rollout.engine_kwargs: one section per engine plugin that has one (adapters.plugins.SECTIONS),
    each declared with its plugin (adapters/<engine>/config.py)."""

    def engine(self, name: str) -> Any:
        """rollout.engine_kwargs.<name> (None: an engine with no section)."""
        return getattr(self, name, None) if name in SECTIONS else None

    if TYPE_CHECKING:  # the sections are the plugins' (their attributes are made from SECTIONS)
        def __getattr__(self, name: str) -> Any: ...


@attrs.frozen(kw_only=True)
class VerifyConfig:
    """rollout.verify: the post-refit probe."""

    enabled: bool = setting(
        (bool,), False,
        "after each refit, compare the engine's log-probs on a small fixed batch with the trainer's "
        "([post-refit verification](verification.md)); beyond the bound the refit fails with "
        "`ProbeMismatch` and the engine is stale")
    max_abs_logp_diff: float | None = setting(
        (int, float, NoneType), None,
        "the probe's bound on max \\|Δlog p\\| (0 or more); null = the plan's per-format bound ([the "
        "bounds](verification.md#bounds))",
        check=_optional_non_negative)
    batch: int = setting(
        (int,), 2,
        "sequences in the probe batch (1 or more)",
        check=_at_least(1))
    seq_len: int = setting(
        (int,), 16,
        "tokens per probe sequence (2 or more)",
        check=_at_least(2))


@attrs.frozen(kw_only=True)
class DeltaConfig:
    """rollout.checkpoint_engine.delta: delta refits (backend layout_delta)."""

    full_every: int = setting(
        (int,), 10,
        "`layout_delta`: a full refit at least every this many refits (1 = every refit is full); a failed "
        "refit, a restarted engine or a base copy that differs also send a full one",
        check=_at_least(1))
    max_host_bytes: int | None = setting(
        (int, NoneType), None,
        "`layout_delta`: cap on each side's host copy of the checkpoint-format tensors, bytes (null = "
        "unlimited: the quantized model's bytes on each side); tensors past it, in stream order, go whole "
        "and are not kept",
        check=_optional_non_negative)


@attrs.frozen(kw_only=True)
class CheckpointEngineConfig:
    """rollout.checkpoint_engine: verl's weight-sync settings."""

    backend: str = setting(
        (str,), "naive",
        "weight-sync backend; one of: naive, nccl, gloo, layout_delta, delta_sharded. `layout_delta` "
        "sends each checkpoint-format tensor as a sparse delta of the rollout's own layout when smaller "
        "(any format, BF16 included; [refit.md](refit.md#delta-refits)); verl's `delta_sharded` is "
        "refused for quantized rollouts (dispatch rule [QuantizedFullSync](plan.md#quantizedfullsync))",
        choices=SYNC_BACKENDS)
    update_weights_bucket_megabytes: float = setting(
        (int, float), 512,
        "size bound of one weight-sync bucket, MiB (at least one byte and at most 1 TiB; fractions "
        "allowed, e.g. `0.0625` = 64 KiB or `1e-3`)",
        check=_bucket_mib)
    restore: str | None = setting(
        (str, NoneType), None,
        "what brings an engine back when a refit fails after it lost its weights: `replay` (re-stream the "
        "previous refit's buckets from a host copy: one quantized copy of the model), `engine` (its own "
        "backup; transactional engines only, a per-layer engine is refused) or `stale` (it refuses to "
        "serve until a full refit); null = the one that costs no copy "
        "([refit.md](refit.md#when-a-refit-fails-restore))",
        choices=(None, "replay", "engine", "stale"))
    delta: DeltaConfig = attrs.field(factory=DeltaConfig)

    @property
    def bucket_bytes(self) -> int:
        """update_weights_bucket_megabytes in bytes (the schema checked it holds at least one)."""
        return int(self.update_weights_bucket_megabytes * 2**20)


# What the engine keys' docs say of each engine, from the plugin table (docs/configuration.md is
# generated from these docs).
_BUILT = ", ".join(name for name, plugin in PLUGINS.items() if plugin.build is not None)
_DEPLOYMENTS = "; ".join(f"{name}: {', '.join(d for d in DEPLOYMENTS if d in plugin.deployments)}"
                         for name, plugin in PLUGINS.items() if plugin.build is not None)


@attrs.frozen(kw_only=True)
class RolloutConfig:
    """rollout: the engine, its quantization, its weight sync."""

    name: str = setting(
        (str,), "reference",
        f"rollout engine; one of: {', '.join(ENGINES)} (the composition root builds {_BUILT}; the others "
        "are planned for: `refit plan`, the export)",
        choices=ENGINES)
    commit_mode: str | None = setting(
        (str, NoneType), None,
        "how the engine commits a refit: `transactional` or `per-layer`; null = the engine's own "
        "([engines](engines.md)); a value the engine cannot honour is an error",
        check=_commit_mode)
    quantization: QuantizationConfig = attrs.field(factory=QuantizationConfig)
    engine_kwargs: EngineKwargsConfig = attrs.field(factory=EngineKwargsConfig)
    deployment: str = setting(
        (str,), "colocated",
        "where the engine runs: `colocated` (in the trainer's process, verl's hybrid engine; buckets pass "
        "by reference), `disaggregated` (a server of the engine that rl-refit starts on loopback and "
        "refits as an attached one; buckets travel through a shared-memory ring or a side process group; "
        "[the server rl-refit starts](engines.md#the-server-rl-refit-starts)) or `attached` (a server "
        "you started, at the engine section's `url`; [attach](attach.md)). Each engine runs in its "
        f"own: {_DEPLOYMENTS}. See [engines](engines.md)",
        choices=DEPLOYMENTS)
    replicas: int = setting(
        (int,), 1,
        "engine replicas (data-parallel rollout) that one refit updates, all or nothing: each bucket goes "
        "to every replica, the refit is live when every replica finalized, and a failure in any leaves "
        "every replica serving the old weights or none serving; the engine's section says in which "
        "deployments it runs replicas. See "
        "[your own model](your-model.md#tensor-parallel-engines-and-replicas)",
        check=_at_least(1))
    verify: VerifyConfig = attrs.field(factory=VerifyConfig)
    checkpoint_engine: CheckpointEngineConfig = attrs.field(factory=CheckpointEngineConfig)
    wire_format: str = setting(
        (str,), "bucketed",
        "how buckets travel; one of: bucketed, delta_flush",
        choices=WIRE_FORMATS)


@attrs.frozen(kw_only=True)
class QatConfig:
    """actor.megatron.qat: fake quantization in training."""

    enable: bool = setting(
        (bool,), False,
        "QAT fake-quantization in training")
    mode: str | None = setting(
        (str, NoneType), None,
        "the QAT mode: verl's `fp8`, `mxfp8`, `mxfp4`, `mxfp4_mxfp8`, `nvfp4` (also `w4a16`, "
        "`FP8_BLOCK`); weights and activations must match the rollout (see QAT modes)",
        check=_qat_mode)
    ignore_patterns: tuple[str, ...] = setting(
        (list, tuple, str), (),
        "modules QAT keeps BF16 (fnmatch, e.g. `*mlp.gate`); the rollout must keep them BF16 too",
        check=_patterns)


@attrs.frozen(kw_only=True)
class TransformerOverridesConfig:
    """actor.megatron.override_transformer_config: Transformer Engine training recipes."""

    fp8: str | bool | None = setting(
        (str, bool, NoneType), None,
        "Transformer Engine FP8 training: e4m3 or hybrid; null/false = off",
        choices=(None, False, "e4m3", "hybrid"))
    fp8_recipe: str | None = setting(
        (str, NoneType), None,
        "TE FP8 recipe: delayed, tensorwise, blockwise, mxfp8",
        choices=(None, "delayed", "tensorwise", "blockwise", "mxfp8"))
    fp4: str | bool | None = setting(
        (str, bool, NoneType), None,
        "Transformer Engine FP4 training: e2m1; null/false = off",
        choices=(None, False, "e2m1"))
    fp4_recipe: str | None = setting(
        (str, NoneType), None,
        "TE FP4 recipe: nvfp4",
        choices=(None, "nvfp4"))
    first_last_layers_bf16: bool = setting(
        (bool,), False,
        "keep the first/last layers BF16 in FP8/FP4 training")
    num_layers_at_start_in_bf16: int = setting(
        (int,), 1,
        "BF16 layers at the start (with `first_last_layers_bf16`), 0 or more",
        check=_non_negative)
    num_layers_at_end_in_bf16: int = setting(
        (int,), 1,
        "BF16 layers at the end (with `first_last_layers_bf16`), 0 or more",
        check=_non_negative)


@attrs.frozen(kw_only=True)
class MegatronConfig:
    """actor.megatron: the Megatron trainer's QAT, recipes, parallel sizes and GDN kernels."""

    qat: QatConfig = attrs.field(factory=QatConfig)
    override_transformer_config: TransformerOverridesConfig = attrs.field(factory=TransformerOverridesConfig)
    tensor_model_parallel_size: int = setting(
        (int,), 1,
        "the Megatron trainer's tensor-parallel size: the sharded refit's layout "
        "(`Services.world.refit_world`), checked against Megatron's `parallel_state`",
        check=_positive)
    pipeline_model_parallel_size: int = setting(
        (int,), 1,
        "its pipeline-parallel size",
        check=_positive)
    expert_model_parallel_size: int = setting(
        (int,), 1,
        "its expert-parallel size",
        check=_positive)
    expert_tensor_parallel_size: int | None = setting(
        (int, NoneType), None,
        "its expert tensor-parallel size; null = Megatron's default, the tensor-parallel size (the refit "
        "exports 1, the tensor-parallel size, or any size with a tensor-parallel size of 1)",
        check=_positive_or_none)
    gdn_kernels: str = setting(
        (str,), "auto",
        "GatedDeltaNet packed-sequence kernels: auto, reference, fla, causal_conv1d",
        choices=("auto", "reference", "fla", "causal_conv1d"))


@attrs.frozen(kw_only=True)
class HfTrainerConfig:
    """actor.hf: the Hugging Face trainer."""

    load_model: bool = setting(
        (bool,), False,
        "with `actor.strategy: hf` and `model.path`: load the checkpoint as a `transformers` model (in "
        "memory, trainable: what `refit demo ENGINE --model DIR` perturbs) instead of streaming its files")


@attrs.frozen(kw_only=True)
class LoraConfig:
    """actor.lora: a LoRA adapter on the trainer, and how its refits reach the engine."""

    rank: int = setting(
        (int,), 0,
        "a LoRA adapter of this rank on the embedded trainer (seeded, all seven projections); 0: none. A "
        "PEFT model brings its own ([LoRA](lora.md))",
        check=_at_least(0))
    alpha: float | None = setting(
        (int, float, NoneType), None,
        "PEFT's `lora_alpha` (null: 2 × rank); the scaling is alpha / rank",
        check=_positive_or_none)
    sync: str = setting(
        (str,), "merged",
        "how a LoRA trainer's refits reach the engine: `merged` sends W + (alpha/r)·B·A like any model "
        "(every format and engine); `adapter` sends the adapter alone each step and the base only when it "
        "changed, into an engine that serves adapters ([LoRA](lora.md))",
        choices=("merged", "adapter"))


@attrs.frozen(kw_only=True)
class ActorConfig:
    """actor: the trainer."""

    megatron: MegatronConfig = attrs.field(factory=MegatronConfig)
    fused_forward: str | bool | int | None = setting(
        (str, bool, int, NoneType), None,
        "fused log-prob forward mode (auto, hook, legacy and their aliases); null = auto; any other value "
        "is a `FusedForwardModeError` when the configuration loads (`refit plan` too)",
        check=_fused_forward)
    strategy: str = setting(
        (str,), "reference",
        "the trainer adapter the composition root builds (verl's key for the trainer): `reference` (the "
        "embedded model), `megatron` (a built Megatron model handed to `bootstrap(config, model=...)`) or "
        "`hf` (a `transformers` model handed to `bootstrap(config, model=...)`, else `model.path` "
        "streamed from its safetensors files, tensor by tensor); verl's `fsdp` and `fsdp2` are accepted "
        "in a verl file but have no adapter",
        choices=("reference", "megatron", "hf", "fsdp", "fsdp2"))
    hf: HfTrainerConfig = attrs.field(factory=HfTrainerConfig)
    lora: LoraConfig = attrs.field(factory=LoraConfig)


@attrs.frozen(kw_only=True)
class ModelConfig:
    """model: the Hugging Face checkpoint."""

    path: str | None = setting(
        (str, NoneType), None,
        "Hugging Face checkpoint directory (`--model DIR` sets it). With `actor.strategy: reference` the "
        "embedded model takes the checkpoint's shapes (a Qwen3 / Qwen3-MoE `config.json`) and weights "
        "instead of `reference.model`'s; with `actor.strategy: hf` it is the trainer's source ([your own "
        "model](your-model.md))")


@attrs.frozen(kw_only=True)
class ReferenceConfig:
    """reference: the embedded reference model."""

    model: str = setting(
        (str,), "tiny-moe",
        "the embedded reference model (trainer and engine): tiny-moe, tiny-dense, micro-moe, micro-dense, "
        "bench-moe, bench-quick",
        choices=("tiny-moe", "tiny-dense", "micro-moe", "micro-dense", "bench-moe", "bench-quick"))
    seed: int = setting(
        (int,), 0,
        "seed of the embedded model's random weights")
    device: str = setting(
        (str,), "cpu",
        "where the embedded reference engine's weights live and its forward runs: `cpu`, `cuda` or "
        "`cuda:N`",
        check=_torch_device)


@attrs.frozen(kw_only=True)
class RefitConfig:
    """The whole configuration, validated: `config.rollout.quantization.linear`.

    Attributes:
        unused: the keys of a verl file that rl-refit does not read (as written there); not part
            of the configuration's value (equality and `to_dict` leave it out).
    """

    rollout: RolloutConfig = attrs.field(factory=RolloutConfig)
    actor: ActorConfig = attrs.field(factory=ActorConfig)
    model: ModelConfig = attrs.field(factory=ModelConfig)
    reference: ReferenceConfig = attrs.field(factory=ReferenceConfig)
    unused: tuple[str, ...] = attrs.field(default=(), converter=_names, eq=False)

    @classmethod
    def from_values(cls, values: Mapping[str, Any], unused: tuple[str, ...] = ()) -> RefitConfig:
        """The configuration of {dotted key: value} (keys left out take their defaults).

        Args:
            values: values by schema key, e.g. {"rollout.deployment": "attached"}.
            unused: the keys of a verl file that rl-refit does not read.
        """
        return cls(**_fields_from(cls, "", values), unused=unused)

    def __getitem__(self, key: str) -> object:
        """The value (or section) of a dotted key, `config["rollout.name"]`; KeyError otherwise."""
        node: object = self
        for part in key.split("."):
            kind = type(node)
            if not attrs.has(kind) or part not in attrs.fields_dict(kind) or part == "unused":
                raise KeyError(key)
            node = getattr(node, part)
        return node

    def get(self, key: str, default: object = None) -> object:
        """The value of a dotted key, or `default` when there is no such key."""
        try:
            return self[key]
        except KeyError:
            return default

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain nested data (what load_config reads back to an equal one)."""
        tree = attrs.asdict(self, filter=lambda a, _: a.name != "unused")
        return json.loads(json.dumps(tree, default=list))


def _fields_from(cls: type, prefix: str, values: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in attrs.fields(cls):
        section = section_of(field)
        if section is not None:
            out[field.name] = section(**_fields_from(section, f"{prefix}{field.name}.", values))
        elif "setting" in field.metadata and f"{prefix}{field.name}" in values:
            out[field.name] = values[f"{prefix}{field.name}"]
    return out


def section_keys(cls: type = RefitConfig, prefix: str = "") -> dict[str, str]:
    """{dotted path of each typed field: the schema key its converter checks} (tests compare them)."""
    out: dict[str, str] = {}
    for field in attrs.fields(cls):
        section = section_of(field)
        if section is not None:
            out.update(section_keys(section, f"{prefix}{field.name}."))
        elif "setting" in field.metadata:
            key = field.metadata["setting"].key
            out[prefix + field.name] = key.path if key is not None else ""
    return out


# Every key, in the tree's order, each named by its dotted path from here on.
SCHEMA: tuple[Key, ...] = declare(RefitConfig)
KEYS: dict[str, Key] = {k.path: k for k in SCHEMA}
