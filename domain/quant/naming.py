"""Hugging Face tensor naming: what a tensor is, which fused group it belongs to, ignore matching.

Pure string logic over tensor names and shapes (each tensor's kind as docs/plan.md shows it).
Recognised layouts:
dense decoders (`model.layers.N.self_attn.q_proj.weight`), MoE with per-expert tensors
(`mlp.experts.N.{gate,up,down}_proj.weight`, Mixtral's `block_sparse_moe.experts.N.w{1,2,3}`),
MoE with fused 3-D expert tensors (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I]), vision-language prefixes (`model.language_model.`, `language_model.model.`) and
GatedDeltaNet blocks (`linear_attn.*`).
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Iterable, Sequence
from typing import Literal, get_args

import attrs

from domain.quant.patterns import regex_problem

# What a tensor is to the plan: a dense Linear weight, a routed expert's weight, or never quantized.
TensorKind = Literal["dense", "expert", "passthrough"]

# Module names that stay BF16 whatever the rollout asks
# (docs/configuration.md#where-the-rollout-quantization-comes-from), written in
# the ignore-entry syntax so the same list goes to the engine's quantization_config.
# Vision towers are kept BF16 too: engines serve them unquantized in every published recipe.
DEFAULT_IGNORE_REASONS: dict[str, str] = {
    "lm_head": "output head",
    "re:.*embed_tokens$": "token embedding",
    r"re:.*mlp\.gate$": "MoE router",
    r"re:.*\.router$": "MoE router",
    "re:.*shared_expert_gate$": "shared-expert gate",
    # GatedDeltaNet b/a projections feed the gating nonlinearities; released FP8 checkpoints keep
    # them BF16 and engines do not block-quantize them (their output is 2 x heads wide).
    r"re:.*linear_attn\.in_proj_(ba|a|b)$": "GatedDeltaNet b/a projection",
    r"re:(.*\.)?(visual|vision_tower|vision_model|multi_modal_projector)\..*": "vision tower",
}
DEFAULT_IGNORE: tuple[str, ...] = tuple(DEFAULT_IGNORE_REASONS)

# Routed experts as engines name them (`...mlp.experts` for the fused layer, `...experts.3.up_proj`
# per expert); never `shared_experts` / `shared_expert`.
EXPERTS_PATTERN = r"re:.*\.experts(\..*)?$"

_PARAM_SUFFIXES = (".weight", ".bias")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT_2D = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)$")
_EXPERT_3D = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)(?:\.weight)?$")
_QKV = re.compile(r"^(?P<prefix>.*)\.(?P<proj>q_proj|k_proj|v_proj)$")
_GATE_UP = re.compile(r"^(?P<prefix>.*)\.(?P<proj>gate_proj|up_proj|w1|w3)$")
_EMBEDDING = re.compile(r"(^|\.)(embed_tokens|embed_positions|wte|wpe|word_embeddings|position_embeddings|tok_embeddings|embedding)$")

# Members of each kind of fused group, by projection name.
QKV_MEMBERS = ("q_proj", "k_proj", "v_proj")
GATE_UP_MEMBERS = ("gate_proj", "up_proj")
MIXTRAL_GATE_UP_MEMBERS = ("w1", "w3")


@attrs.frozen
class TensorClass:
    """What one tensor is, from its name and shape alone.

    Attributes:
        kind: "dense" (a Linear weight), "expert" (a routed expert's weight, 2-D or fused 3-D) or
            "passthrough" (never quantized: norms, biases, embeddings, convolutions).
        module: the module name (the tensor name without `.weight`); for fused 3-D experts the
            tensor name itself.
        group: the fused group sharing one global scale (q/k/v, gate/up), or None.
        fused_experts: True for a 3-D tensor holding every expert.
        reason: why, in words.
    """

    kind: TensorKind = attrs.field(validator=attrs.validators.in_(get_args(TensorKind)))
    module: str
    group: str | None
    fused_experts: bool
    reason: str


def module_name(name: str) -> str:
    """The module a tensor belongs to: `a.b.q_proj.weight` -> `a.b.q_proj`.

    Args:
        name: full tensor name.

    Returns:
        The name without its `.weight` / `.bias` suffix (unchanged when it has none).
    """
    for suffix in _PARAM_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def layer_index(name: str) -> int | None:
    """The decoder layer a tensor belongs to (`...layers.7...` -> 7), or None outside layers.

    Args:
        name: full tensor name.

    Returns:
        The first `layers.N` index in the name, or None.
    """
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def natural_key(name: str) -> tuple[object, ...]:
    """Sort key putting `layers.2` before `layers.10` (layer order, not string order).

    Args:
        name: full tensor name.

    Returns:
        A tuple comparing numbers as numbers.
    """
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def group_members(group: str) -> tuple[str, ...]:
    """Module names of every member of a fused group.

    Args:
        group: a group name from `classify` (`...self_attn.qkv`, `...mlp.gate_up`, `...w1_w3`).

    Returns:
        The module names whose weights share the group's global scale.
    """
    prefix, _, kind = group.rpartition(".")
    members = {"qkv": QKV_MEMBERS, "gate_up": GATE_UP_MEMBERS, "w1_w3": MIXTRAL_GATE_UP_MEMBERS}[kind]
    return tuple(f"{prefix}.{m}" for m in members)


def _group_of(module: str) -> str | None:
    m = _QKV.match(module)
    if m:
        return f"{m['prefix']}.qkv"
    m = _GATE_UP.match(module)
    if m:
        return f"{m['prefix']}.{'w1_w3' if m['proj'] in MIXTRAL_GATE_UP_MEMBERS else 'gate_up'}"
    return None


@functools.lru_cache(maxsize=1 << 16)
def classify(name: str, shape: tuple[int, ...]) -> TensorClass:
    """Classify one tensor for quantization, from its Hugging Face name and shape (a pure
    function, cached: every refit classifies the same names again).

    Args:
        name: full tensor name, e.g. `model.layers.0.self_attn.q_proj.weight`.
        shape: the tensor's shape.

    Returns:
        Its TensorClass: dense / expert / passthrough, its fused group and the reason.
    """
    module = module_name(name)
    m3 = _EXPERT_3D.match(name)
    if m3 and len(shape) == 3:
        return TensorClass("expert", name, None, True, f"fused 3-D expert tensor [{shape[0]} experts]")
    if not name.endswith(".weight"):
        return TensorClass("passthrough", module, None, False, "not a Linear weight (bias or buffer)")
    if len(shape) != 2:
        return TensorClass("passthrough", module, None, False, f"not a 2-D Linear weight ({len(shape)}-D)")
    if _EMBEDDING.search(module):
        return TensorClass("passthrough", module, None, False, "token embedding stays BF16")
    default = first_match(DEFAULT_IGNORE, name)
    if default is not None:
        return TensorClass("passthrough", module, None, False, f"{DEFAULT_IGNORE_REASONS[default]} stays BF16 (default ignore '{default}')")
    if _EXPERT_2D.match(module):
        return TensorClass("expert", module, _group_of(module), False, "routed expert Linear")
    return TensorClass("dense", module, _group_of(module), False, "dense Linear")


def expert_split(name: str, shape: tuple[int, ...]) -> list[tuple[str, int, slice]]:
    """How a fused 3-D expert tensor splits into per-expert checkpoint modules.

    `gate_up_proj` [E, 2I, H] holds gate rows then up rows; `down_proj` is [E, H, I].

    Args:
        name: the fused tensor's name, e.g. `model.layers.0.mlp.experts.gate_up_proj`.
        shape: its 3-D shape.

    Returns:
        (module name, expert index, row slice) for every per-expert 2-D weight it holds.
    """
    m = _EXPERT_3D.match(name)
    if m is None or len(shape) != 3:
        raise ValueError(f"{name!r} is not a fused 3-D expert tensor")
    prefix, experts, rows = m["prefix"], shape[0], shape[1]
    if m["proj"] == "down_proj":
        return [(f"{prefix}.{e}.down_proj", e, slice(0, rows)) for e in range(experts)]
    half = rows // 2
    out = []
    for e in range(experts):
        out.append((f"{prefix}.{e}.gate_proj", e, slice(0, half)))
        out.append((f"{prefix}.{e}.up_proj", e, slice(half, rows)))
    return out


# --- ignore matching -------------------------------------------------------------------------


def _entry_matches(entry: str, candidate: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], candidate) is not None
    if any(c in entry for c in "*?["):
        return fnmatch.fnmatchcase(candidate, entry)
    return candidate == entry or candidate.endswith("." + entry)


def ignore_matches(entry: str, name: str) -> bool:
    """Whether one ignore entry keeps tensor `name` in BF16.

    Entry syntax: `re:REGEX` (re.match, anchored at the start, as compressed-tensors does); a
    shell pattern with `*`, `?` or `[` (fnmatch, as Megatron QAT configs write `*mlp.gate`);
    otherwise an exact module or tensor name, or a suffix of one at a dot boundary (`mlp.gate`
    matches `model.layers.0.mlp.gate` but never `mlp.gate_proj`).

    Args:
        entry: one ignore entry.
        name: a full tensor name or a module name.

    Returns:
        True when the entry matches the module name or the full tensor name.
    """
    module = module_name(name)
    return _entry_matches(entry, module) or (module != name and _entry_matches(entry, name))


def first_match(entries: Iterable[str], name: str) -> str | None:
    """The first ignore entry that matches `name`, or None.

    Args:
        entries: ignore entries (see `ignore_matches`).
        name: a full tensor name.

    Returns:
        The matching entry, or None.
    """
    return next((e for e in entries if ignore_matches(e, name)), None)


def validate_ignore_entry(entry: str) -> str | None:
    """Why an ignore entry is malformed, or None when it is fine.

    Args:
        entry: one ignore entry.

    Returns:
        A short problem description, or None.
    """
    if not isinstance(entry, str) or not entry.strip():
        return "an ignore entry must be a non-empty string"
    if entry.startswith("re:"):
        return regex_problem(entry[3:])  # invalid, or unbounded matching work (domain.quant.patterns)
    return None


def exact_entry(entry: str) -> str:
    """An ignore entry with compressed-tensors' own semantics, in rl-refit's syntax.

    A compressed-tensors `ignore` (or `targets`) entry is a `re:` pattern (re.match) or an exact
    module name; rl-refit also reads a plain entry as a dot suffix and a `*` entry as a shell
    pattern. A user's config is honoured as written, so its plain entries become exact names.

    Args:
        entry: one entry of a compressed-tensors config's `ignore` list.

    Returns:
        The entry itself when it is a `re:` pattern, else `re:<escaped name>$`.
    """
    return entry if entry.startswith("re:") else f"re:{re.escape(entry)}$"


def is_class_target(target: str) -> bool:
    """Whether a compressed-tensors target names a module class (`Linear`) rather than a layer.

    Args:
        target: one entry of a config group's `targets`.

    Returns:
        True for a dotless CamelCase name such as `Linear` or `QKVParallelLinear`.
    """
    return not target.startswith("re:") and "." not in target and target[:1].isupper()


def target_matches(target: str, module: str) -> bool:
    """Whether a name target (`re:` pattern or exact layer name) selects `module`, as engines
    resolve compressed-tensors targets (re.match for patterns, equality otherwise).

    Args:
        target: a target that is not a class name.
        module: a module name.

    Returns:
        True on a match.
    """
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


_EXPERTS_LAYER = re.compile(r"^(?P<layer>.*\.experts)\.")


def experts_layer(module: str) -> str | None:
    """The fused MoE layer an expert module belongs to (`...mlp.experts.3.up_proj` ->
    `...mlp.experts`), as engines name it; None outside routed experts.

    Args:
        module: a module name (or a fused 3-D expert tensor's name).

    Returns:
        The layer name, or None.
    """
    m = _EXPERTS_LAYER.match(module)
    return m["layer"] if m else None


def yaml_list(entries: Sequence[str]) -> str:
    """Ignore entries as a YAML flow list in single quotes, which keep backslashes as written:
    what a user can paste into a YAML file or a `KEY=VALUE` override.

    Args:
        entries: ignore entries.

    Returns:
        e.g. `['lm_head', 're:.*\\.down_proj$']` (one backslash each when printed).
    """
    return "[" + ", ".join("'" + e.replace("'", "''") + "'" for e in entries) + "]"


def to_engine_pattern(entry: str) -> str:
    """Translate an ignore entry into the syntax engines read (exact name or `re:` + re.match).

    Args:
        entry: one ignore entry.

    Returns:
        A `re:` pattern matching the same module names (the entry itself when already `re:`).
    """
    if entry.startswith("re:"):
        return entry
    if any(c in entry for c in "*?["):
        return "re:" + fnmatch.translate(entry)
    return f"re:(.*\\.)?{re.escape(entry)}$"


def name_list(value: object) -> tuple[str, ...] | None:
    """A config's list of module names or patterns (`ignore`, `targets`, `ignored_layers`) as a
    tuple; a single string is a list of one, nothing (None, empty) is empty. None when the value is
    neither: the caller says which field is malformed.

    Args:
        value: the field's value as the config holds it.

    Returns:
        The entries, or None for a value of another type.
    """
    if not value:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return None
