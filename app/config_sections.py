"""The typed configuration: frozen attrs sections, one per level of the verl-style key tree.

`app.config.load_config` parses and validates a file, a dict or dotted overrides once and returns
a `RefitConfig`; Python callers (the CLI, the benchmarks) build the same sections directly, e.g.
`RefitConfig(rollout=RolloutConfig(name="vllm"))`, and change them with `attrs.evolve`. Every
field is one key of app.config_schema.SCHEMA: its default, and a converter that runs the key's
check, so a value set in Python is validated, normalized and named in errors exactly as one read
from YAML (`rollout.quantization.linear=fp8_block` and `QuantizationConfig(linear="fp8_block")`
both hold "FP8_BLOCK").
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from app.config_schema import KEYS, validate_value


def _names(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(items)


def _key(path: str) -> Any:
    """The field of the schema key `path`: its default, its check as the converter."""
    key = KEYS[path]
    default = attrs.Factory(dict) if isinstance(key.default, dict) else key.default
    return attrs.field(default=default, converter=functools.partial(validate_value, key), metadata={"key": path})


@attrs.frozen(kw_only=True)
class QuantizationConfig:
    """rollout.quantization: what the rollout is served in (docs/configuration.md#keys)."""

    linear: str | None = _key("rollout.quantization.linear")
    moe: str | None = _key("rollout.quantization.moe")
    moe_activation: str | None = _key("rollout.quantization.moe_activation")
    linear_activation: str | None = _key("rollout.quantization.linear_activation")
    ignore: tuple[str, ...] = _key("rollout.quantization.ignore")
    config_file: str | None = _key("rollout.quantization.config_file")
    allow_config_rewrite: bool = _key("rollout.quantization.allow_config_rewrite")
    numerics: str = _key("rollout.quantization.numerics")
    scale_rule: str | None = _key("rollout.quantization.scale_rule")


@attrs.frozen(kw_only=True)
class VllmEngineConfig:
    """rollout.engine_kwargs.vllm: the vLLM engine's arguments and rl-refit's settings for it."""

    hf_overrides: Mapping[str, Any] | None = _key("rollout.engine_kwargs.vllm.hf_overrides")
    use_deep_gemm: bool | None = _key("rollout.engine_kwargs.vllm.use_deep_gemm")
    kv_cache_dtype: str = _key("rollout.engine_kwargs.vllm.kv_cache_dtype")
    engine_args: Mapping[str, Any] = _key("rollout.engine_kwargs.vllm.engine_args")
    environment: Mapping[str, Any] = _key("rollout.engine_kwargs.vllm.environment")
    python: str | None = _key("rollout.engine_kwargs.vllm.python")
    start_timeout_s: float = _key("rollout.engine_kwargs.vllm.start_timeout_s")
    transport: str = _key("rollout.engine_kwargs.vllm.transport")
    cpu_emulation: str = _key("rollout.engine_kwargs.vllm.cpu_emulation")
    url: str | None = _key("rollout.engine_kwargs.vllm.url")
    urls: tuple[str, ...] = _key("rollout.engine_kwargs.vllm.urls")
    api_key: str | None = _key("rollout.engine_kwargs.vllm.api_key")
    pause_mode: str = _key("rollout.engine_kwargs.vllm.pause_mode")
    reset_running_requests: bool = _key("rollout.engine_kwargs.vllm.reset_running_requests")


@attrs.frozen(kw_only=True)
class SglangEngineConfig:
    """rollout.engine_kwargs.sglang: the SGLang engine's settings."""

    hf_overrides: Mapping[str, Any] | None = _key("rollout.engine_kwargs.sglang.hf_overrides")
    use_deep_gemm: bool | None = _key("rollout.engine_kwargs.sglang.use_deep_gemm")
    kv_cache_dtype: str = _key("rollout.engine_kwargs.sglang.kv_cache_dtype")
    url: str | None = _key("rollout.engine_kwargs.sglang.url")
    api_key: str | None = _key("rollout.engine_kwargs.sglang.api_key")
    pause_mode: str = _key("rollout.engine_kwargs.sglang.pause_mode")


@attrs.frozen(kw_only=True)
class EngineKwargsConfig:
    """rollout.engine_kwargs: one section per real engine."""

    vllm: VllmEngineConfig = attrs.field(factory=VllmEngineConfig)
    sglang: SglangEngineConfig = attrs.field(factory=SglangEngineConfig)

    def engine(self, name: str) -> VllmEngineConfig | SglangEngineConfig | None:
        """rollout.engine_kwargs.<name>, for the settings every engine section has (None: an
        engine with no section)."""
        sections: dict[str, VllmEngineConfig | SglangEngineConfig] = {"vllm": self.vllm, "sglang": self.sglang}
        return sections.get(name)


@attrs.frozen(kw_only=True)
class VerifyConfig:
    """rollout.verify: the post-refit probe."""

    enabled: bool = _key("rollout.verify.enabled")
    max_abs_logp_diff: float | None = _key("rollout.verify.max_abs_logp_diff")
    batch: int = _key("rollout.verify.batch")
    seq_len: int = _key("rollout.verify.seq_len")


@attrs.frozen(kw_only=True)
class DeltaConfig:
    """rollout.checkpoint_engine.delta: delta refits (backend layout_delta)."""

    full_every: int = _key("rollout.checkpoint_engine.delta.full_every")
    max_host_bytes: int | None = _key("rollout.checkpoint_engine.delta.max_host_bytes")


@attrs.frozen(kw_only=True)
class CheckpointEngineConfig:
    """rollout.checkpoint_engine: verl's weight-sync settings."""

    backend: str = _key("rollout.checkpoint_engine.backend")
    update_weights_bucket_megabytes: float = _key("rollout.checkpoint_engine.update_weights_bucket_megabytes")
    restore: str | None = _key("rollout.checkpoint_engine.restore")
    delta: DeltaConfig = attrs.field(factory=DeltaConfig)

    @property
    def bucket_bytes(self) -> int:
        """update_weights_bucket_megabytes in bytes (the schema checked it holds at least one)."""
        return int(self.update_weights_bucket_megabytes * 2**20)


@attrs.frozen(kw_only=True)
class RolloutConfig:
    """rollout: the engine, its quantization, its weight sync."""

    name: str = _key("rollout.name")
    commit_mode: str | None = _key("rollout.commit_mode")
    quantization: QuantizationConfig = attrs.field(factory=QuantizationConfig)
    engine_kwargs: EngineKwargsConfig = attrs.field(factory=EngineKwargsConfig)
    deployment: str = _key("rollout.deployment")
    replicas: int = _key("rollout.replicas")
    verify: VerifyConfig = attrs.field(factory=VerifyConfig)
    checkpoint_engine: CheckpointEngineConfig = attrs.field(factory=CheckpointEngineConfig)
    wire_format: str = _key("rollout.wire_format")


@attrs.frozen(kw_only=True)
class QatConfig:
    """actor.megatron.qat: fake quantization in training."""

    enable: bool = _key("actor.megatron.qat.enable")
    mode: str | None = _key("actor.megatron.qat.mode")
    ignore_patterns: tuple[str, ...] = _key("actor.megatron.qat.ignore_patterns")


@attrs.frozen(kw_only=True)
class TransformerOverridesConfig:
    """actor.megatron.override_transformer_config: Transformer Engine training recipes."""

    fp8: str | bool | None = _key("actor.megatron.override_transformer_config.fp8")
    fp8_recipe: str | None = _key("actor.megatron.override_transformer_config.fp8_recipe")
    fp4: str | bool | None = _key("actor.megatron.override_transformer_config.fp4")
    fp4_recipe: str | None = _key("actor.megatron.override_transformer_config.fp4_recipe")
    first_last_layers_bf16: bool = _key("actor.megatron.override_transformer_config.first_last_layers_bf16")
    num_layers_at_start_in_bf16: int = _key("actor.megatron.override_transformer_config.num_layers_at_start_in_bf16")
    num_layers_at_end_in_bf16: int = _key("actor.megatron.override_transformer_config.num_layers_at_end_in_bf16")


@attrs.frozen(kw_only=True)
class MegatronConfig:
    """actor.megatron: the Megatron trainer's QAT, recipes, parallel sizes and GDN kernels."""

    qat: QatConfig = attrs.field(factory=QatConfig)
    override_transformer_config: TransformerOverridesConfig = attrs.field(factory=TransformerOverridesConfig)
    tensor_model_parallel_size: int = _key("actor.megatron.tensor_model_parallel_size")
    pipeline_model_parallel_size: int = _key("actor.megatron.pipeline_model_parallel_size")
    expert_model_parallel_size: int = _key("actor.megatron.expert_model_parallel_size")
    expert_tensor_parallel_size: int | None = _key("actor.megatron.expert_tensor_parallel_size")
    gdn_kernels: str = _key("actor.megatron.gdn_kernels")


@attrs.frozen(kw_only=True)
class HfTrainerConfig:
    """actor.hf: the Hugging Face trainer."""

    load_model: bool = _key("actor.hf.load_model")


@attrs.frozen(kw_only=True)
class LoraConfig:
    """actor.lora: a LoRA adapter on the trainer, and how its refits reach the engine."""

    rank: int = _key("actor.lora.rank")
    alpha: float | None = _key("actor.lora.alpha")
    sync: str = _key("actor.lora.sync")


@attrs.frozen(kw_only=True)
class ActorConfig:
    """actor: the trainer."""

    megatron: MegatronConfig = attrs.field(factory=MegatronConfig)
    fused_forward: str | bool | int | None = _key("actor.fused_forward")
    strategy: str = _key("actor.strategy")
    hf: HfTrainerConfig = attrs.field(factory=HfTrainerConfig)
    lora: LoraConfig = attrs.field(factory=LoraConfig)


@attrs.frozen(kw_only=True)
class ModelConfig:
    """model: the Hugging Face checkpoint."""

    path: str | None = _key("model.path")


@attrs.frozen(kw_only=True)
class ReferenceConfig:
    """reference: the embedded reference model."""

    model: str = _key("reference.model")
    seed: int = _key("reference.seed")
    device: str = _key("reference.device")


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
            values: values by schema key, e.g. {"rollout.name": "vllm"}.
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


def _section_type(field: attrs.Attribute[Any]) -> type | None:
    factory = getattr(field.default, "factory", None)  # a section field's default is its class
    return factory if isinstance(factory, type) and attrs.has(factory) else None


def _fields_from(cls: type, prefix: str, values: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field in attrs.fields(cls):
        section = _section_type(field)
        if section is not None:
            out[field.name] = section(**_fields_from(section, f"{prefix}{field.name}.", values))
        elif field.metadata.get("key") in values:
            out[field.name] = values[field.metadata["key"]]
    return out


def section_keys(cls: type = RefitConfig, prefix: str = "") -> dict[str, str]:
    """{dotted path of each typed field: the schema key its converter checks} (tests compare them)."""
    out: dict[str, str] = {}
    for field in attrs.fields(cls):
        section = _section_type(field)
        if section is not None:
            out.update(section_keys(section, f"{prefix}{field.name}."))
        elif "key" in field.metadata:
            out[prefix + field.name] = field.metadata["key"]
    return out
