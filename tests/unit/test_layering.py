"""The hexagon's dependency rule, enforced by reading every module's imports."""

from __future__ import annotations

import ast
import functools
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEAVY = {"vllm", "sglang", "megatron", "modelopt", "transformer_engine", "fla", "structlog",
         "compressed_tensors", "torchao", "transformers", "safetensors", "rich", "yaml", "causal_conv1d"}
DOMAIN_ALLOWED_THIRD_PARTY = {"attrs", "torch"}


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _modules(package: str) -> list[pathlib.Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", _modules("domain"), ids=lambda p: str(p.relative_to(ROOT)))
def test_domain_imports_only_stdlib_attrs_and_torch(path: pathlib.Path) -> None:
    import sys

    imported = _imports(path)
    outer = imported & {"ports", "adapters", "app"}
    third_party = {m for m in imported - {"domain"} if m not in sys.stdlib_module_names}
    assert not outer, f"{path} imports outer layers {outer}"
    assert third_party <= DOMAIN_ALLOWED_THIRD_PARTY, f"{path} imports {third_party - DOMAIN_ALLOWED_THIRD_PARTY}"
    text = path.read_text()
    assert "os.environ" not in text and "getenv" not in text, f"{path} reads the environment"


@pytest.mark.parametrize("path", _modules("ports"), ids=lambda p: str(p.relative_to(ROOT)))
def test_ports_import_only_the_domain(path: pathlib.Path) -> None:
    imported = _imports(path)
    assert not imported & ({"adapters", "app"} | HEAVY), f"{path} imports {imported}"


# The composition roots: the trainer's, and the one vLLM calls in its own processes (where no
# rl-refit root runs) to read the one setting the trainer's root passed down to the engine.
ROOTS = {ROOT / "app" / "bootstrap.py", ROOT / "adapters" / "vllm" / "plugin.py"}


def test_only_the_composition_roots_read_the_environment() -> None:
    readers = [
        p for pkg in ("domain", "ports", "adapters", "app") for p in _modules(pkg)
        if ("os.environ" in p.read_text() or "getenv(" in p.read_text()) and p not in ROOTS
    ]
    assert readers == [], f"environment read outside the composition roots: {readers}"


# --- the rooms inside the layers -------------------------------------------------------------

# Which domain sub-packages each one may import at run time (errors, mismatch and environment
# import none of them: they are the leaves every room uses).
DOMAIN_ROOMS = {
    "quant": {"quant"},
    "refit": {"refit", "quant"},
    "forward": {"forward"},
    "errors": set(),  # domain/errors/: a package of modules that import only one another
    "": set(),  # domain/mismatch.py, environment.py
}
# Sub-packages that are leaves: every room may import them, and they import no room.
DOMAIN_LEAVES = {"errors"}
# Packages the base install does not have (they come with an extra, or with the engine's own
# environment). An adapter module that imports one of them, anywhere in it, is imported by the
# composition root only, in the branch that selects it.
OPTIONAL_PACKAGES = {"vllm", "sglang", "megatron", "modelopt", "fla", "transformer_engine", "causal_conv1d"}


def _runtime_imports(path: pathlib.Path) -> set[str]:
    """Full module names imported, also inside functions; `if TYPE_CHECKING:` blocks skipped."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
               and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
               for n in ast.walk(node)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _room(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT / "domain").parts
    return parts[0] if len(parts) > 1 else ""


@pytest.mark.parametrize("path", _modules("domain"), ids=lambda p: str(p.relative_to(ROOT)))
def test_domain_rooms_import_only_the_rooms_they_build_on(path: pathlib.Path) -> None:
    room = _room(path)
    used = {m.split(".")[1] for m in _runtime_imports(path) if m.startswith("domain.") and m.count(".") >= 1}
    used = {u for u in used if u in DOMAIN_ROOMS and u not in DOMAIN_LEAVES}  # sub-packages, not the leaves
    assert used <= DOMAIN_ROOMS[room], f"{path} (domain/{room or '.'}) imports domain/{used - DOMAIN_ROOMS[room]}"
    assert not any(m.startswith("torch.distributed") for m in _runtime_imports(path)), (
        f"{path} uses torch.distributed: collectives reach the domain through a seam (an adapter)")


@pytest.mark.parametrize("path", _modules("adapters"), ids=lambda p: str(p.relative_to(ROOT)))
def test_adapters_never_import_the_application(path: pathlib.Path) -> None:
    assert not {m for m in _runtime_imports(path) if m.split(".")[0] == "app"}, f"{path} imports app/"


@functools.cache
def _optional_adapter_modules() -> frozenset[str]:
    out = set()
    for path in _modules("adapters"):
        if {m.split(".")[0] for m in _runtime_imports(path)} & OPTIONAL_PACKAGES:
            out.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return frozenset(out)


def test_the_optional_adapters_are_the_engine_and_trainer_adapters() -> None:
    optional = _optional_adapter_modules()
    # what the rule below protects: the real engines' clients, Megatron, ModelOpt
    assert {"adapters.vllm.client", "adapters.sglang.client", "adapters.modelopt.backend",
            "adapters.megatron.trainer_model"} <= optional
    assert "adapters.sglang.engine" not in optional  # the SGLang adapter itself runs without SGLang


@pytest.mark.parametrize("path", _modules("app"), ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_composition_root_imports_optional_adapters(path: pathlib.Path) -> None:
    if path.name == "bootstrap.py":
        return
    optional = _optional_adapter_modules()
    bad = sorted(m for m in _runtime_imports(path) if m in optional or m.rpartition(".")[0] in optional)
    assert not bad, f"{path} imports {bad}, which need an optional package; get them from app.bootstrap"


@pytest.mark.parametrize("path", sorted((ROOT / "app" / "services").rglob("*.py")) + sorted((ROOT / "app" / "cli").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_services_know_no_root_and_the_cli_no_adapter(path: pathlib.Path) -> None:
    imported = _runtime_imports(path)
    if path.parent.name == "services":
        assert not {m for m in imported if m.startswith(("app.bootstrap", "app.cli", "app.bench"))}, (
            f"{path}: services are built by the composition root and know neither it nor the CLI")
    else:
        assert not {m for m in imported if m.startswith("adapters")}, (
            f"{path}: the CLI gets every adapter from app.bootstrap")
