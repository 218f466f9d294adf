"""The configuration's keys: every verl-style key once, with its types, default, allowed values,
check and one line of help (docs/configuration.md documents the same table).

`validate_value(key, value)` is the one check a value passes, whether it came from a YAML file,
a dotted override or a typed section built in Python (app.config_sections).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from adapters.profiles import ENGINES
from domain.errors import ConfigError, ConfigTypeError
from domain.forward.mode import parse_fused_forward_mode
from domain.quant import naming
from domain.quant.formats import FORMATS, ActivationScheme, ElementRule, MxScaleRule
from domain.quant.qat_modes import canonical_qat_mode
from domain.quant.rules import DELTA_BACKENDS, DELTA_WIRE_FORMATS, LAYOUT_DELTA_BACKEND

NoneType = type(None)
SYNC_BACKENDS = ("naive", "nccl", "gloo", LAYOUT_DELTA_BACKEND, *DELTA_BACKENDS)
WIRE_FORMATS = ("bucketed", *DELTA_WIRE_FORMATS)
VLLM_TRANSPORTS = ("shm", "gloo", "nccl", "cuda_ipc", "auto")  # domain.refit.transport_choice.CHOICES


def _short(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters (messages quote what the user wrote)."""
    try:
        text = repr(value)
    except ValueError:  # an int too long for repr (sys.get_int_max_str_digits)
        text = f"<an integer of about {int(value.bit_length() * 0.30103)} digits>"
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


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


def _urls(key: str, value: Any) -> tuple[str, ...]:
    items = tuple(value)
    for item in items:
        if not isinstance(item, str) or not item.startswith(("http://", "https://")):
            raise ConfigError(key, f"{_short(item)} is not an http(s) URL: give each replica's server as http://HOST:PORT")
    return items


def _url(key: str, value: Any) -> Any:
    if value is not None and not str(value).startswith(("http://", "https://")):
        raise ConfigError(key, f"{_short(value)} is not an http(s) URL: give the server as http://HOST:PORT")
    return value


def _qat_mode(key: str, value: Any) -> Any:
    if value is None:
        return None
    canonical_qat_mode(value, key)  # validates; the value is kept as written, for messages
    return str(value).strip()


def _fused_forward(key: str, value: Any) -> Any:
    parse_fused_forward_mode(value, key=key)  # validates; the value is kept as written (bootstrap reads it)
    return value


def _hf_overrides(key: str, value: Any) -> Any:
    if isinstance(value, str) and value.strip():
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigError(key, f"not valid JSON ({err.msg} at char {err.pos}); write a dict or a JSON object") from None
        except (ValueError, RecursionError) as err:  # integers too long, nesting too deep
            reason = "nested too deeply" if isinstance(err, RecursionError) else str(err).split(";")[0]
            raise ConfigError(key, f"not valid JSON ({reason}); write a dict or a JSON object") from None
        if not isinstance(value, dict):
            raise ConfigError(key, f"the JSON string must hold an object, got {type(value).__name__}")
    return value or None


MAX_DEPTH = 32  # nesting of a configuration value: far beyond any real one, well within recursion


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Mapping | list | tuple):
            deepest = max(deepest, depth)
            children = node.values() if isinstance(node, Mapping) else node
            stack.extend((child, depth + 1) for child in children if depth <= MAX_DEPTH)
    return deepest


def _check_plain(key: str, value: Any) -> Any:
    """A value must be plain data: JSON-like types, nested at most MAX_DEPTH levels."""
    if _depth(value) > MAX_DEPTH:
        raise ConfigError(key, f"the value is nested more than {MAX_DEPTH} levels deep; flatten it")
    try:
        json.dumps(value)
    except (TypeError, ValueError) as err:
        raise ConfigTypeError(key, f"the value holds something that is not plain data ({err}); "
                              "use strings, numbers, booleans, null, lists and mappings") from None
    return value


def _commit_mode(key: str, value: Any) -> Any:
    if value is None:
        return None
    name = str(value).strip().lower().replace("_", "-")
    if name not in ("transactional", "per-layer"):
        raise ConfigError(key, f"invalid value {value!r}; valid: transactional, per-layer (or null)")
    return name


def _positive(key: str, value: Any) -> Any:
    if not value > 0:  # NaN is not positive either
        raise ConfigError(key, f"must be positive, got {_short(value)}")
    return value


MAX_BUCKET_MIB = 1 << 20  # 1 TiB: a bucket is a buffer every rank allocates


def _bucket_mib(key: str, value: Any) -> Any:
    _positive(key, value)
    if value * 2**20 < 1:
        raise ConfigError(key, f"must hold at least one byte ({2**-20:.3g} MiB), got {_short(value)}")
    if value > MAX_BUCKET_MIB:
        raise ConfigError(key, f"must be at most {MAX_BUCKET_MIB} MiB (1 TiB), got {_short(value)}")
    return value


def _positive_seconds(key: str, value: Any) -> Any:
    if not (value > 0 and math.isfinite(value)):  # NaN fails both; .inf would wait forever
        raise ConfigError(key, f"must be a finite positive number of seconds, got {_short(value)}")
    return value


def _at_least(minimum: int) -> Callable[[str, Any], Any]:
    def check(key: str, value: Any) -> Any:
        if value < minimum:
            raise ConfigError(key, f"must be {minimum} or more, got {_short(value)}")
        return value

    return check


def _optional_non_negative(key: str, value: Any) -> Any:
    return value if value is None else _non_negative(key, value)


def _positive_or_none(key: str, value: Any) -> Any:
    return value if value is None else _positive(key, value)


def _emulation_mode(key: str, value: Any) -> str:
    """auto, on or off; YAML reads a bare on/off as true/false."""
    mode = {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else str(value).strip().lower()
    if mode not in ("auto", "on", "off"):
        raise ConfigError(key, f"invalid value {_short(value)}; valid: auto, on, off")
    return mode


def _torch_device(key: str, value: Any) -> str:
    """cpu, cuda or cuda:N (whether that GPU is there is checked when the engine is built)."""
    text = str(value).strip().lower()
    head, _, index = text.partition(":")
    if head not in ("cpu", "cuda") or (index and (head == "cpu" or not index.isdigit())):
        raise ConfigError(key, f"invalid device {_short(value)}; valid: cpu, cuda, cuda:N")
    return text


def _non_negative(key: str, value: Any) -> Any:
    if value < 0:
        raise ConfigError(key, f"must be 0 or more, got {_short(value)}")
    return value


@attrs.frozen
class Key:
    """One configuration key: dotted path, accepted types, default, allowed values, help."""

    path: str
    types: tuple[type, ...]
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None
    check: Callable[[str, Any], Any] | None = None
    free: bool = False  # a free-form dict: keys below it are not checked


SCHEMA: tuple[Key, ...] = (
    Key("rollout.name", (str,), "reference", "rollout engine", choices=ENGINES),
    Key("rollout.commit_mode", (str, NoneType), None,
        "how the engine commits a refit: transactional or per-layer; null = the engine's own "
        "(reference: transactional, vllm: per-layer, sglang: transactional)", check=_commit_mode),
    Key("rollout.quantization.linear", (str, NoneType), None,
        "preset for dense Linear layers (FP8_BLOCK, MXFP8, MXFP4, NVFP4); null = BF16", check=_preset),
    Key("rollout.quantization.moe", (str, NoneType), None,
        "preset for routed experts; null = BF16", check=_preset),
    Key("rollout.quantization.moe_activation", (str, NoneType), None,
        "experts' activation scheme (e.g. nvfp4_per_token, mxfp8); null = the preset's default", check=_activation),
    Key("rollout.quantization.linear_activation", (str, NoneType), None,
        "dense layers' activation scheme (none = weight-only); null = the preset's default", check=_activation),
    Key("rollout.quantization.ignore", (list, tuple, str), (),
        "modules kept BF16, added to the defaults: names, dot suffixes, re:REGEX, fnmatch", check=_patterns),
    Key("rollout.quantization.config_file", (str, NoneType), None,
        "a compressed-tensors quantization_config JSON file used instead of linear/moe"),
    Key("rollout.quantization.allow_config_rewrite", (bool,), False,
        "true: a config_file / hf_overrides quantization_config that cannot be honoured as written is "
        "rewritten from the presets (refit plan lists every change) instead of rejected"),
    Key("rollout.quantization.numerics", (str,), ElementRule.ENGINE.value,
        "element rule: engine (the engine's own quantizers and the QAT kernels) or compressed-tensors "
        "(llm-compressor checkpoints byte for byte)", choices=tuple(r.value for r in ElementRule)),
    Key("rollout.quantization.scale_rule", (str, NoneType), None,
        "MX shared-exponent rule for both MX formats: rceil or even; null = the element rule's choice "
        "(engine: MXFP8 rceil, MXFP4 even; compressed-tensors: even)",
        choices=(None, *(r.value for r in MxScaleRule))),
    Key("rollout.engine_kwargs.vllm.hf_overrides", (dict, str, NoneType), None,
        "vLLM hf_overrides (dict or JSON string); its quantization_config wins, null = BF16",
        check=_hf_overrides, free=True),
    Key("rollout.engine_kwargs.sglang.hf_overrides", (dict, str, NoneType), None,
        "SGLang hf_overrides (dict or JSON string)", check=_hf_overrides, free=True),
    Key("rollout.engine_kwargs.vllm.use_deep_gemm", (bool, NoneType), None,
        "false restores vLLM's automatic kernel selection (no DeepGEMM requests); null = policy"),
    Key("rollout.engine_kwargs.sglang.use_deep_gemm", (bool, NoneType), None,
        "false restores SGLang's automatic kernel selection; null = policy"),
    Key("rollout.engine_kwargs.vllm.kv_cache_dtype", (str,), "auto",
        "vLLM's KV-cache dtype (auto, fp8, fp8_e4m3, fp8_e5m2)", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2")),
    Key("rollout.deployment", (str,), "colocated",
        "where the engine runs: colocated (in the trainer's process, verl's hybrid engine: buckets by "
        "reference), disaggregated (its own processes: buckets over a side process group) or attached (a "
        "vLLM or SGLang server the user started: rollout.engine_kwargs.vllm.url or "
        "rollout.engine_kwargs.sglang.url; rl-refit starts nothing)",
        choices=("colocated", "disaggregated", "attached")),
    Key("rollout.replicas", (int,), 1,
        "engine replicas (data-parallel rollout) one refit updates, all or nothing; vLLM replicas run "
        "disaggregated (each in processes of its own)", check=_at_least(1)),
    Key("rollout.engine_kwargs.vllm.engine_args", (dict,), {},
        "other vllm.LLM arguments, as given (model, dtype, max_model_len, enforce_eager, tensor_parallel_size, ...)",
        free=True),
    Key("rollout.engine_kwargs.vllm.environment", (dict,), {},
        "environment variables the vLLM engine starts with (e.g. VLLM_CPU_KVCACHE_SPACE)", free=True),
    Key("rollout.engine_kwargs.vllm.python", (str, NoneType), None,
        "disaggregated: the Python that runs the vLLM server (vLLM and rl-refit installed); null = "
        "$RL_REFIT_VLLM_PYTHON, else .venv-vllm/bin/python in the working directory or beside the "
        "rl-refit checkout, else this Python"),
    Key("rollout.engine_kwargs.vllm.start_timeout_s", (int, float), 120,
        "disaggregated: seconds the vLLM server may take to start serving; past them it is killed with "
        "its engine processes", check=_positive_seconds),
    Key("rollout.engine_kwargs.vllm.transport", (str,), "shm",
        "disaggregated and attached: how buckets reach the server's workers: shm (a shared-memory ring on this host), "
        "gloo (a process group over TCP), nccl (GPU to GPU, any hosts), cuda_ipc (the trainer's GPU buffers "
        "mapped by workers on this host) or auto (by where the tensors and workers live; docs/engines.md)",
        choices=VLLM_TRANSPORTS),
    Key("rollout.engine_kwargs.vllm.url", (str, NoneType), None,
        "attached: the vLLM server's base URL (http://127.0.0.1:8000), started with dev mode and "
        "--weight-transfer-config '{\"backend\": \"rl_refit\"}' (docs/attach.md)", check=_url),
    Key("rollout.engine_kwargs.vllm.urls", (list, tuple), (),
        "attached: one URL per replica, refitted together (instead of url)", check=_urls),
    Key("rollout.engine_kwargs.vllm.api_key", (str, NoneType), None, "attached: the server's --api-key, if any"),
    Key("rollout.engine_kwargs.vllm.pause_mode", (str,), "keep",
        "disaggregated and attached: how the server's generation pauses around a refit: keep (in-flight requests freeze and continue "
        "after it), abort, or wait (let them finish first)", choices=("keep", "abort", "wait")),
    Key("rollout.engine_kwargs.vllm.reset_running_requests", (bool,), False,
        "disaggregated and attached: also drop the KV of requests in flight when the refit ends, so their continuation is "
        "computed with the new weights (on-policy)"),
    Key("rollout.engine_kwargs.vllm.cpu_emulation", (str, bool), "auto",
        "vLLM's CPU platform only: emulated matmuls for formats with no native kernel on this CPU "
        "(auto), for every format (on), or none (off); see docs/engines.md", check=_emulation_mode),
    Key("rollout.verify.enabled", (bool,), False,
        "after each refit, compare the engine's log-probs on a small fixed batch with the trainer's; "
        "a mismatch beyond the bound fails the refit and leaves the engine stale"),
    Key("rollout.verify.max_abs_logp_diff", (int, float, NoneType), None,
        "the probe's bound; null = the plan's per-format bound (docs/verification.md)",
        check=_optional_non_negative),
    Key("rollout.verify.batch", (int,), 2, "sequences in the probe batch", check=_at_least(1)),
    Key("rollout.verify.seq_len", (int,), 16, "tokens per probe sequence", check=_at_least(2)),
    Key("rollout.engine_kwargs.sglang.kv_cache_dtype", (str,), "auto",
        "SGLang's KV-cache dtype (auto, fp8_e4m3, fp8_e5m2)", choices=("auto", "fp8_e4m3", "fp8_e5m2")),
    Key("rollout.engine_kwargs.sglang.url", (str, NoneType), None,
        "attached: the SGLang server's base URL (http://127.0.0.1:30000), started with "
        "--custom-weight-loader adapters.sglang.loader.load (docs/attach.md)", check=_url),
    Key("rollout.engine_kwargs.sglang.api_key", (str, NoneType), None,
        "attached: the server's --api-key or --admin-api-key, if any"),
    Key("rollout.engine_kwargs.sglang.pause_mode", (str,), "retract",
        "attached: SGLang's pause mode around a refit: retract (in-flight requests wait and continue after "
        "it, their KV recomputed with the new weights), in_place (they freeze on their old KV) or abort",
        choices=("retract", "in_place", "abort")),
    Key("rollout.checkpoint_engine.backend", (str,), "naive", "weight-sync backend", choices=SYNC_BACKENDS),
    Key("rollout.checkpoint_engine.update_weights_bucket_megabytes", (int, float), 512,
        "size bound of one weight-sync bucket, MiB", check=_bucket_mib),
    Key("rollout.checkpoint_engine.delta.full_every", (int,), 10,
        "layout_delta: a full refit at least every this many refits (1 = always full)", check=_at_least(1)),
    Key("rollout.checkpoint_engine.delta.max_host_bytes", (int, NoneType), None,
        "layout_delta: cap on each side's host copy of the checkpoint-format tensors, bytes; tensors past "
        "it go whole and are not kept; null = unlimited (the quantized model's bytes)",
        check=_optional_non_negative),
    Key("rollout.checkpoint_engine.restore", (str, NoneType), None,
        "what brings an engine back when a refit fails after it lost its weights: replay (re-stream the "
        "previous refit's buckets from a host copy), engine (its own backup; transactional engines only) or "
        "stale; null = the one that costs no copy (docs/refit.md)", choices=(None, "replay", "engine", "stale")),
    Key("rollout.wire_format", (str,), "bucketed", "how buckets travel", choices=WIRE_FORMATS),
    Key("actor.megatron.qat.enable", (bool,), False, "QAT fake-quantization in training"),
    Key("actor.megatron.qat.mode", (str, NoneType), None,
        "QAT mode: verl's fp8, mxfp8, mxfp4, mxfp4_mxfp8, nvfp4 (or w4a16, FP8_BLOCK); must match the rollout",
        check=_qat_mode),
    Key("actor.megatron.qat.ignore_patterns", (list, tuple, str), (),
        "modules QAT keeps BF16 (fnmatch, e.g. *mlp.gate)", check=_patterns),
    Key("actor.megatron.override_transformer_config.fp8", (str, bool, NoneType), None,
        "Transformer Engine FP8 training (e4m3, hybrid); null = off", choices=(None, False, "e4m3", "hybrid")),
    Key("actor.megatron.override_transformer_config.fp8_recipe", (str, NoneType), None,
        "TE FP8 recipe", choices=(None, "delayed", "tensorwise", "blockwise", "mxfp8")),
    Key("actor.megatron.override_transformer_config.fp4", (str, bool, NoneType), None,
        "Transformer Engine FP4 training (e2m1); null = off", choices=(None, False, "e2m1")),
    Key("actor.megatron.override_transformer_config.fp4_recipe", (str, NoneType), None,
        "TE FP4 recipe", choices=(None, "nvfp4")),
    Key("actor.megatron.override_transformer_config.first_last_layers_bf16", (bool,), False,
        "keep the first/last layers BF16 in FP8/FP4 training"),
    Key("actor.megatron.override_transformer_config.num_layers_at_start_in_bf16", (int,), 1,
        "BF16 layers at the start (with first_last_layers_bf16)", check=_non_negative),
    Key("actor.megatron.override_transformer_config.num_layers_at_end_in_bf16", (int,), 1,
        "BF16 layers at the end (with first_last_layers_bf16)", check=_non_negative),
    Key("actor.megatron.tensor_model_parallel_size", (int,), 1,
        "the Megatron trainer's tensor-parallel size (the sharded refit's layout)", check=_positive),
    Key("actor.megatron.pipeline_model_parallel_size", (int,), 1,
        "the Megatron trainer's pipeline-parallel size", check=_positive),
    Key("actor.megatron.expert_model_parallel_size", (int,), 1,
        "the Megatron trainer's expert-parallel size", check=_positive),
    Key("actor.megatron.expert_tensor_parallel_size", (int, NoneType), None,
        "the Megatron trainer's expert tensor-parallel size; null = Megatron's default (the tensor-parallel size)",
        check=_positive_or_none),
    Key("actor.megatron.gdn_kernels", (str,), "auto",
        "GatedDeltaNet packed kernels", choices=("auto", "reference", "fla", "causal_conv1d")),
    Key("actor.fused_forward", (str, bool, int, NoneType), None,
        "fused log-prob forward mode (auto, hook, legacy and aliases); null = auto", check=_fused_forward),
    Key("model.path", (str, NoneType), None, "Hugging Face checkpoint directory"),
    Key("actor.strategy", (str,), "reference",
        "the trainer adapter: reference (the embedded model), megatron, or hf (a transformers model passed "
        "as model=, else model.path streamed from its safetensors files); verl's fsdp and fsdp2 have none",
        choices=("reference", "megatron", "hf", "fsdp", "fsdp2")),
    Key("actor.hf.load_model", (bool,), False,
        "actor.strategy hf with model.path: load the checkpoint as a transformers model (in memory, trainable: "
        "what refit demo --model DIR perturbs) instead of streaming its safetensors files tensor by tensor"),
    Key("actor.lora.rank", (int,), 0,
        "the LoRA adapter's rank r on the embedded trainer (0: no adapter; a PEFT model brings its own)",
        check=_at_least(0)),
    Key("actor.lora.alpha", (int, float, NoneType), None, "PEFT's lora_alpha; null = 2 * rank",
        check=_positive_or_none),
    Key("actor.lora.sync", (str,), "merged",
        "how a LoRA trainer's refits reach the engine: merged (W + (alpha/r) B A, quantized and refitted whole: "
        "every format and engine) or adapter (the adapter alone each step, the base only when it changed, "
        "into an engine that serves adapters)", choices=("merged", "adapter")),
    Key("reference.model", (str,), "tiny-moe", "the embedded reference model",
        choices=("tiny-moe", "tiny-dense", "micro-moe", "micro-dense", "bench-moe", "bench-quick")),
    Key("reference.seed", (int,), 0, "seed of the embedded reference model's random weights"),
    Key("reference.device", (str,), "cpu", "where the embedded reference engine's weights live and its forward "
        "runs: cpu, cuda or cuda:N", check=_torch_device),
)
KEYS: dict[str, Key] = {k.path: k for k in SCHEMA}


def validate_value(key: Key, value: Any) -> Any:
    """`value` checked against `key` (types, choices, its check) and normalized; errors name the key."""
    _check_plain(key.path, value)
    ok = isinstance(value, key.types) and not (isinstance(value, bool) and bool not in key.types)
    if not ok:
        names = " or ".join("null" if t is NoneType else t.__name__ for t in key.types)
        raise ConfigTypeError(key.path, f"expected {names}, got {type(value).__name__} {_short(value)}")
    if key.choices is not None and value not in key.choices:
        valid = ", ".join("null" if c is None else str(c) for c in key.choices)
        raise ConfigError(key.path, f"invalid value {_short(value)}; valid: {valid}")
    value = key.check(key.path, value) if key.check else value
    if isinstance(value, float) and not math.isfinite(value):  # a NaN bound passes every `<` check, and fails all
        raise ConfigError(key.path, f"must be a finite number, got {value}")
    return value
