"""Plan service: configuration (+ optional checkpoint) -> resolution, per-tensor decisions, engine config."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs

from adapters.profiles import profile_for
from adapters.system.files import read_regular
from app.config_sections import RefitConfig
from domain.errors import ConfigError
from domain.quant import naming
from domain.quant.dispatch import DispatchInput, Resolution, resolve
from domain.quant.native_config import is_compressed_tensors, override_quantization_config
from domain.quant.native_layout import check_native_tensors
from domain.quant.plan import QuantizationPlan, TensorDecision, parse_numerics, parse_scale_rule
from ports.engine_profile import EngineProfile


class _Checkpoint(Protocol):
    @property
    def config(self) -> dict[str, Any]: ...

    def tensor_shapes(self, raw: bool = False) -> list[tuple[str, tuple[int, ...]]]: ...

    def tensor_specs(self, raw: bool = False) -> list[tuple[str, tuple[int, ...], Any]]: ...

    def decoded_formats(self) -> dict[str, int]: ...

    def check_decodable(self) -> None: ...


@attrs.frozen
class PlanReport:
    """Everything `refit plan` shows.

    Attributes:
        engine: rollout.name.
        resolution: the dispatch's decision (plan, source, layout, rule outcomes).
        decisions: one per tensor of the model, in layer order (empty without a model).
        shapes: the model's (name, shape) pairs (empty without a model).
        engine_config: the quantization_config the engine is sent (None for BF16).
        unused_keys: keys of a verl configuration file that rl-refit does not read.
        decoded: preset -> modules the checkpoint stores quantized in it, which the plan sees
            (and an export writes) as the dense weights they decode to; empty when none, and
            for layouts that pass the checkpoint through untouched.
    """

    engine: str
    resolution: Resolution
    decisions: tuple[TensorDecision, ...]
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    engine_config: dict[str, Any] | None
    unused_keys: tuple[str, ...] = ()
    decoded: dict[str, int] = attrs.field(factory=dict)

    @property
    def plan(self) -> QuantizationPlan:
        return self.resolution.plan


def read_config_file(path: str) -> dict[str, Any]:
    """Read rollout.quantization.config_file: a quantization_config JSON, or a config.json holding one.

    Args:
        path: the file.

    Returns:
        The quantization_config dict.
    """
    key = "rollout.quantization.config_file"
    file = Path(path)
    if file.is_dir():
        raise ConfigError(key, f"{path!r} is a directory; give the quantization_config JSON file")
    if not file.exists():
        raise ConfigError(key, f"file {path!r} does not exist")
    if not file.is_file():
        raise ConfigError(key, f"{path!r} is not a regular file; give the quantization_config JSON file")
    try:
        data = json.loads(read_regular(file).decode("utf-8"))  # never blocks on a FIFO swapped in meanwhile
    except UnicodeDecodeError as err:
        raise ConfigError(key, f"{path}: not UTF-8 text (byte {err.start})") from None
    except (ValueError, RecursionError) as err:
        reason = "nested too deeply" if isinstance(err, RecursionError) else str(err).split(";")[0]
        raise ConfigError(key, f"{path}: not valid JSON ({reason})") from None
    except OSError as err:
        raise ConfigError(key, f"{path}: cannot be read ({err.strerror or err})") from None
    if not isinstance(data, dict):
        raise ConfigError(key, f"{path}: expected a JSON object")
    return data.get("quantization_config", data) if isinstance(data.get("quantization_config"), dict) else data


def dispatch_input(cfg: RefitConfig, model_config: Mapping[str, Any] | None, purpose: str = "refit") -> DispatchInput:
    """Translate the configuration into the dispatch rules' input.

    Args:
        cfg: the validated configuration.
        model_config: the checkpoint's config.json, or None.
        purpose: "refit" (default) or "export" (domain.quant.dispatch.PURPOSES).

    Returns:
        The DispatchInput.
    """
    q = cfg.rollout.quantization
    requested = None
    if q.linear is not None or q.moe is not None:
        requested = QuantizationPlan.from_presets(
            linear=q.linear, moe=q.moe, moe_activation=q.moe_activation,
            linear_activation=q.linear_activation, scale_rule=q.scale_rule, numerics=q.numerics,
        )
    elif q.moe_activation is not None or q.linear_activation is not None:
        key = "moe_activation" if q.moe_activation is not None else "linear_activation"
        raise ConfigError(f"rollout.quantization.{key}", "is set but rollout.quantization.linear and moe are null")
    engine = cfg.rollout.name
    overrides_key = f"rollout.engine_kwargs.{engine}.hf_overrides"
    # the engines driven through their own package take hf_overrides; the others have none
    section = cfg.rollout.engine_kwargs.engine(engine)
    hf_overrides = None if section is None else section.hf_overrides
    config_file = read_config_file(q.config_file) if q.config_file else None
    check_user_configs(config_file, hf_overrides, overrides_key)
    te = cfg.actor.megatron.override_transformer_config
    return DispatchInput(
        engine=engine,
        requested=requested,
        ignore=q.ignore,
        config_file=config_file,
        hf_overrides=hf_overrides,
        hf_overrides_key=overrides_key,
        model_config=model_config,
        qat_enable=cfg.actor.megatron.qat.enable,
        qat_mode=cfg.actor.megatron.qat.mode,
        qat_ignore=cfg.actor.megatron.qat.ignore_patterns,
        te_fp8=te.fp8,
        te_fp4=te.fp4,
        first_last_layers_bf16=te.first_last_layers_bf16,
        num_layers_at_start_in_bf16=te.num_layers_at_start_in_bf16,
        num_layers_at_end_in_bf16=te.num_layers_at_end_in_bf16,
        sync_backend=cfg.rollout.checkpoint_engine.backend,
        wire_format=cfg.rollout.wire_format,
        allow_config_rewrite=q.allow_config_rewrite,
        purpose=purpose,
    )


def check_user_configs(config_file: Mapping[str, Any] | None, hf_overrides: Mapping[str, Any] | str | None,
                       overrides_key: str) -> None:
    """The compressed-tensors quantization_configs a user supplies (a config_file, one in the
    engine's hf_overrides) must be ones compressed-tensors' own QuantizationConfig accepts, before
    anything reads them (adapters.compressed_tensors.check_user_config).

    Args:
        config_file: the parsed rollout.quantization.config_file, or None.
        hf_overrides: the engine's hf_overrides (a dict, a JSON string or None).
        overrides_key: its configuration key.

    Returns:
        None. Raises ConfigError naming the key and the fields compressed-tensors rejects.
    """
    override = override_quantization_config(hf_overrides, overrides_key)
    given = [(config_file, "rollout.quantization.config_file"), (override, f"{overrides_key}.quantization_config")]
    for qc, key in given:
        if isinstance(qc, Mapping) and is_compressed_tensors(qc):
            from adapters.compressed_tensors.quantization_config import check_user_config

            check_user_config(qc, key)


def with_numerics(plan: QuantizationPlan, cfg: RefitConfig) -> QuantizationPlan:
    """The plan with rollout.quantization.numerics and scale_rule applied, whatever chose its presets
    (linear/moe, a config_file or the checkpoint's own quantization_config).

    Args:
        plan: the resolved plan.
        cfg: the validated configuration.

    Returns:
        The plan, evolved only when a rule differs.
    """
    q = cfg.rollout.quantization
    numerics, rule = parse_numerics(q.numerics), parse_scale_rule(q.scale_rule)
    if plan.numerics is numerics and plan.scale_rule is rule:
        return plan
    return attrs.evolve(plan, numerics=numerics, scale_rule=rule)


def _linear_like(name: str, shape: tuple[int, ...], cls: naming.TensorClass) -> bool:
    """A module an engine may build as a Linear layer: a 2-D weight that is not an embedding, or a
    weight of more dimensions (kept BF16 as it is: a `Linear` target would still reach it)."""
    if not name.endswith(".weight") or len(shape) < 2:
        return False  # norms, biases, buffers
    return len(shape) > 2 or cls.kind != "passthrough" or "default ignore" in cls.reason


def bf16_linear_modules(plan: QuantizationPlan, shapes: Sequence[tuple[str, tuple[int, ...]]]) -> list[str]:
    """Linear modules that stay BF16: what native layouts list as `ignored_layers`, and what a
    compressed-tensors config must keep out of its groups.

    Args:
        plan: the plan.
        shapes: the model's (name, shape) pairs.

    Returns:
        Sorted module names (embeddings, norms and biases excluded; experts also as `...experts`;
        weights of more than two dimensions, which the plan never quantizes, included).
    """
    kept: set[str] = set()
    for name, shape in shapes:
        d = plan.decide(name, shape)
        if d.is_quantized:
            continue
        cls = naming.classify(name, shape)
        if cls.fused_experts:
            kept.update(m for m, _, _ in naming.expert_split(name, shape))
            kept.add(name.rsplit(".", 1)[0])
        elif _linear_like(name, shape, cls):
            kept.add(cls.module)
            if cls.kind == "expert":
                kept.add(cls.module.rsplit(".", 2)[0])
    return sorted(kept)


def make_plan(cfg: RefitConfig, checkpoint: _Checkpoint | None = None, *, purpose: str = "refit",
              profile: EngineProfile | None = None, plan: QuantizationPlan | None = None) -> PlanReport:
    """Resolve the rollout quantization for a configuration (and a model, when given).

    Args:
        cfg: the validated configuration.
        checkpoint: the model (only headers are read), or None.
        purpose: "refit" (default: `refit plan`, the services) or "export" (`refit export`, which
            copies a native layout the trainer cannot produce instead of refusing it).
        profile: the engine's profile (the composition root's pick); None looks rollout.name up
            in adapters.profiles.PROFILES.
        plan: the plan a refit sends, when it is not the configuration's (a demo's arms): the
            report is then that plan's, every rule applied to it as if rollout.quantization
            requested it (a config_file or hf_overrides quantization_config gives way to it).

    Returns:
        The PlanReport. Raises the dispatch rule's typed error when the configuration (or `plan`)
        is rejected.
    """
    report = _make_plan(cfg, checkpoint, purpose, profile, None)
    if plan is None or plan == report.plan:
        return report
    return _make_plan(cfg, checkpoint, purpose, profile, plan)


def _make_plan(cfg: RefitConfig, checkpoint: _Checkpoint | None, purpose: str, profile: EngineProfile | None,
               requested: QuantizationPlan | None) -> PlanReport:
    shapes = tuple(checkpoint.tensor_shapes()) if checkpoint is not None else None
    inp = dispatch_input(cfg, checkpoint.config if checkpoint is not None else None, purpose)
    if requested is not None:  # the plan carries its own ignore list and numerics
        inp = attrs.evolve(inp, requested=requested, ignore=(), config_file=None, hf_overrides=None)
    res = resolve(inp, shapes, engine=(profile or profile_for(inp.engine)).dispatch)
    plan = with_numerics(res.plan, cfg) if requested is None else res.plan
    if plan is not res.plan:
        res = attrs.evolve(res, plan=plan)
    from adapters.engine_quantization import engine_quantization_config

    decoded: dict[str, int] = {}
    if checkpoint is not None and res.layout == "native-passthrough":
        stored = checkpoint.tensor_specs(raw=True)  # passed through as stored
        if purpose == "export" and res.native is not None:  # the files are copied: they must be what it says
            check_native_tensors(res.native.config, res.native.method, stored)
        shapes = tuple((n, s) for n, s, _ in stored)
    elif checkpoint is not None:
        checkpoint.check_decodable()
        decoded = checkpoint.decoded_formats()
    kept = bf16_linear_modules(res.plan, shapes) if shapes is not None else None
    decisions = tuple(res.plan.decide(n, s) for n, s in shapes or ())
    if shapes is not None and res.layout != "native-passthrough":
        check_quantizes_something(cfg, res, decisions)
    engine_config = engine_quantization_config(res, kept, extra_ignore=cfg.rollout.quantization.ignore)
    return PlanReport(cfg.rollout.name, res, decisions, tuple(shapes or ()), engine_config, cfg.unused, decoded)


def check_quantizes_something(cfg: RefitConfig, res: Resolution, decisions: Sequence[TensorDecision]) -> None:
    """A quantized plan must quantize some tensor of the model: otherwise the engine would be told
    to serve a format that no tensor is in (e.g. `moe: NVFP4` on a dense model).

    Args:
        cfg: the configuration (to name the keys).
        res: the resolution.
        decisions: the plan's decision for every tensor of the model.

    Returns:
        None. Raises ConfigError naming the key that asked for quantization.
    """
    plan = res.plan
    if not plan.is_quantized or any(d.is_quantized for d in decisions):
        return
    q = cfg.rollout.quantization
    if res.source == "rollout.quantization":
        asked = [f"rollout.quantization.{k}={v}" for k, v in (("linear", q.linear), ("moe", q.moe)) if v is not None]
        key = asked[0].split("=")[0] if len(asked) == 1 else "rollout.quantization"
        only = "routed experts" if q.linear is None else "dense Linear layers" if q.moe is None else "Linear layers"
        what = f"{' and '.join(asked)} asks to quantize {only}"
    else:
        key = {"config_file": "rollout.quantization.config_file", "checkpoint": "model.path"}.get(
            res.source, f"rollout.engine_kwargs.{cfg.rollout.name}.hf_overrides")
        what = f"the quantization_config from {res.source} asks for quantization"
    found = "no tensor of this model is one" if decisions else "the checkpoint holds no tensors"
    raise ConfigError(key, f"{what}, but {found} (every tensor stays BF16, yet the engine would be told to serve "
                           "quantized weights); set a preset for the layers the model has, or null for a BF16 rollout")


_HOW = {"read": "code read", "cpu": "CPU test", "gpu-script": "GPU script", "cpu-served": "served on CPU"}


def support_matrix_rows(engine: str) -> list[str]:
    """docs/support-matrix.md's table of cells for one engine, from its profile's support table.

    Args:
        engine: rollout.name of an engine with a support table.

    Returns:
        One markdown table row per cell: role, preset, activations, layout, verdict, how it was
        shown, what the engine does (and why a rejected cell is rejected), the code locations.
    """
    table = profile_for(engine).support
    rows = []
    for v in table.verdicts.values() if table is not None else ():
        c = v.cell
        note = v.note[:1].upper() + v.note[1:]
        what = f"{v.engine_path}. " + (f"{note}." if v.shown and v.note else "" if v.shown else
                                      f"Rejected: {v.reason}. Instead: {v.instead}.")
        where = "<br>".join(f"`{w.split(' ', 2)[2]}`" for w in v.where)
        rows.append(f"| {c.role} | {c.fmt} | `{c.activation.value}` | {c.layout} | "
                    f"{'✓ shown' if v.shown else '✗ rejected'} | {', '.join(_HOW[h] for h in v.how)} | "
                    f"{what.strip()} | {where} |")
    return rows
