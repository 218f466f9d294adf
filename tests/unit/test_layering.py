"""The hexagon's dependency rule, enforced by reading every module's imports."""

from __future__ import annotations

import ast
import functools
import pathlib
import re

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
    "lora": {"lora"},
    "errors": set(),  # domain/errors/: a package of modules that import only one another
    "": set(),  # domain/mismatch.py, environment.py
}
# Sub-packages that are leaves: every room may import them, and they import no room.
DOMAIN_LEAVES = {"errors"}
# Packages the base install does not have (they come with an extra, or with the engine's own
# environment). An adapter module that imports one of them, anywhere in it, is imported by the
# composition root only, in the branch that selects it.
OPTIONAL_PACKAGES = {"vllm", "sglang", "megatron", "modelopt", "fla", "transformer_engine", "causal_conv1d"}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    return {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
            for n in ast.walk(node)}


def _runtime_imports(path: pathlib.Path) -> set[str]:
    """Full module names imported, also inside functions; `if TYPE_CHECKING:` blocks skipped."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = _type_checking_nodes(tree)
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
    if path.name == "bootstrap.py" or path.parent.name == "composition":
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
        assert not {m for m in _all_imports(path) if m.startswith("adapters")}, (
            f"{path}: the CLI gets every adapter from app.bootstrap, and names none, not even for types")


# The adapters of an engine or a trainer framework: services reach them through a port and the
# composition root, even where the module itself would import without the package.
ENGINE_ADAPTERS = ("adapters.vllm", "adapters.sglang", "adapters.trtllm", "adapters.megatron", "adapters.modelopt")


@pytest.mark.parametrize("path", sorted((ROOT / "app" / "services").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_services_import_no_engine_or_framework_adapter(path: pathlib.Path) -> None:
    bad = sorted(m for m in _runtime_imports(path) if m.startswith(ENGINE_ADAPTERS))
    assert not bad, f"{path} imports {bad}: give the service a port and build its adapter in app/composition/"


def _all_imports(path: pathlib.Path) -> set[str]:
    """Full module names imported anywhere in a module, `if TYPE_CHECKING:` blocks included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_the_layering_rules_see_imports_in_functions_and_type_checking_blocks(tmp_path: pathlib.Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from adapters.vllm.remote import X\n"
                      "def f():\n    from adapters.sglang import engine\n")
    assert {"adapters.vllm.remote", "adapters.sglang"} <= _all_imports(module)
    assert "adapters.sglang.engine" in _runtime_imports(module)
    assert not any(m.startswith("adapters.vllm") for m in _runtime_imports(module))


# --- the domain knows no engine -----------------------------------------------------------------

# Engine names, however spelled in code: identifiers, attribute names and string constants.
ENGINE_NAME = re.compile(r"vllm|sglang|trtllm", re.IGNORECASE)


def _docstrings(tree: ast.AST) -> set[int]:
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(node.body[0].value) for node in ast.walk(tree) if isinstance(node, nodes) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
            and isinstance(node.body[0].value.value, str)}


def _reference_citations(tree: ast.AST) -> set[int]:
    """The `reference` of each RuleSpec: the function a codec ports bit for bit, cited by name (a
    citation, like a docstring's, that `refit plan` and the export metadata print)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "RuleSpec":
            cited = [*node.args[2:3], *(k.value for k in node.keywords if k.arg == "reference")]
            out.update(id(n) for c in cited for n in ast.walk(c))
    return out


def _names_in_code(path: pathlib.Path) -> list[tuple[int, str]]:
    """Every identifier, attribute, argument, import and string constant (docstrings and RuleSpec
    references aside) of a module, with its line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = _docstrings(tree) | _reference_citations(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            found.append((node.lineno, node.attr))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append((node.lineno, node.name))
        elif isinstance(node, ast.arg):
            found.append((node.lineno, node.arg))
        elif isinstance(node, ast.keyword) and node.arg:
            found.append((node.value.lineno, node.arg))
        elif isinstance(node, ast.alias):
            found.append((node.lineno, f"{node.name} {node.asname or ''}"))
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skipped:
            found.append((node.lineno, node.value))
    return found


@pytest.mark.parametrize("path", _modules("domain"), ids=lambda p: str(p.relative_to(ROOT)))
def test_domain_code_names_no_engine(path: pathlib.Path) -> None:
    named = [f"{path.relative_to(ROOT)}:{line}: {text[:80]!r}" for line, text in _names_in_code(path)
             if ENGINE_NAME.search(text)]
    assert not named, ("engine knowledge belongs to the engine's profile (adapters/<engine>/profile.py), not "
                       "the domain:\n" + "\n".join(named))


def test_the_engine_name_check_sees_code_and_skips_docstrings_and_comments(tmp_path: pathlib.Path) -> None:
    module = tmp_path / "m.py"
    module.write_text('"""About vLLM."""\n# SGLang\ndef f():\n    """TRT-LLM, trtllm."""\n    return 1\n')
    assert not [t for _, t in _names_in_code(module) if ENGINE_NAME.search(t)]
    for code in ('X = "sglang"\n', "def check_vllm(): pass\n", "a.vllm_kernels = 1\n", 'f(f"{x} on vLLM")\n',
                 "import vllm\n", "TRTLLM = 1\n", "def f(sglang_layout): pass\n"):
        module.write_text(code)
        assert [t for _, t in _names_in_code(module) if ENGINE_NAME.search(t)], code


# Configuration keys (`rollout.quantization.linear`, `actor.megatron.qat.mode`, ...) as code spells them.
CONFIG_KEY = re.compile(r"\b(?:rollout|actor)\.[a-z_]")


# --- app/ asks the engine plugins ------------------------------------------------------------------

# The CLI (app/cli/) may spell engine names as its vocabulary: the `refit demo vllm` mode and the
# `--engine` choices. Every other module of app/ asks the plugins (none exists for one engine).
ENGINE_EXACT = re.compile(r"^(vllm|sglang|trtllm)$", re.IGNORECASE)


def _names_an_engine(text: str) -> bool:
    """An engine's name as code spells it: an identifier, a dotted module, an engine's own name as a
    string (not prose in a message, which holds spaces or quotes)."""
    return bool(ENGINE_EXACT.match(text.strip()) or (ENGINE_NAME.search(text) and not any(c in text for c in " `'(")))


def _app_modules_for_every_engine() -> list[pathlib.Path]:
    return [p for p in _modules("app") if "cli" not in p.relative_to(ROOT).parts]


@pytest.mark.parametrize("path", [p for p in _modules("app") if "cli" in p.relative_to(ROOT).parts],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_cli_spells_engine_names_only_as_its_vocabulary(path: pathlib.Path) -> None:
    """The CLI may spell an engine's name as a string (a mode's name, an `--engine` choice, its
    help), but keeps no engine's data: no identifier, import or attribute names an engine (the
    demo defaults are the plugin's, adapters.engine_plugin.DemoDefaults)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    strings = {(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    named = [f"{path.relative_to(ROOT)}:{line}: {text[:80]!r}" for line, text in _names_in_code(path)
             if (line, text) not in strings and ENGINE_NAME.search(text)]
    assert not named, "the CLI names an engine in code; give the engine's plugin a field:\n" + "\n".join(named)


@pytest.mark.parametrize("path", _app_modules_for_every_engine(), ids=lambda p: str(p.relative_to(ROOT)))
def test_app_names_no_engine_but_asks_its_plugin(path: pathlib.Path) -> None:
    """The composition root, the configuration and the services name no engine in code: no
    identifier, import or attribute, and no string constant that is an engine's name (prose in a
    message may cite one, as docstrings do). They ask adapters.plugins.PLUGINS."""
    named = [f"{path.relative_to(ROOT)}:{line}: {text[:80]!r}" for line, text in _names_in_code(path)
             if _names_an_engine(text)]
    assert not named, "ask the engine's plugin (adapters/<engine>/engine_plugin.py) instead:\n" + "\n".join(named)


@pytest.mark.parametrize("path", _modules("app"), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_of_app_compares_an_engine_name_but_the_clis_vocabulary(path: pathlib.Path) -> None:
    """Behaviour that differs by engine is a plugin's field, not `rollout.name == "vllm"`."""
    if "cli" in path.relative_to(ROOT).parts:
        return
    tree = ast.parse(path.read_text(), filename=str(path))
    compared = [f"{path.relative_to(ROOT)}:{n.lineno}" for n in ast.walk(tree) if isinstance(n, ast.Compare)
                for c in ast.walk(n) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                and ENGINE_EXACT.match(c.value)]
    assert not compared, f"a comparison with an engine's name: {compared}; give the plugin a field"


def test_the_app_engine_check_sees_names_and_skips_prose(tmp_path: pathlib.Path) -> None:
    module = tmp_path / "m.py"
    module.write_text('"""About vLLM."""\nraise ValueError("use vllm or the reference engine")\n')
    assert not [t for _, t in _names_in_code(module) if _names_an_engine(t)]
    for code in ('X = "sglang"\n', "def check_vllm(): pass\n", "from adapters.vllm.factory import f\n",
                 "a.engine_kwargs.vllm = 1\n"):
        module.write_text(code)
        assert [t for _, t in _names_in_code(module) if _names_an_engine(t)], code


@pytest.mark.parametrize("path", [p for p in _modules("domain") if p.name != "keys.py"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_domain_spells_configuration_keys_only_through_the_key_function(path: pathlib.Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = _docstrings(tree)
    spelled = [f"{path.relative_to(ROOT)}:{n.lineno}: {n.value[:80]!r}" for n in ast.walk(tree)
               if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
               and CONFIG_KEY.search(n.value)]
    assert not spelled, "write configuration keys with domain.keys.key(...):\n" + "\n".join(spelled)


# --- no import cycle inside the domain ------------------------------------------------------------


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _domain_graph() -> dict[str, set[str]]:
    """Domain module -> the domain modules it imports at run time, anywhere in it (function-local
    imports included; `if TYPE_CHECKING:` blocks, which never run, left out); `from package import
    module` names the module."""
    modules = {_module_name(p) for p in _modules("domain")}
    graph: dict[str, set[str]] = {}
    for path in _modules("domain"):
        targets: set[str] = set()
        tree = ast.parse(path.read_text(), filename=str(path))
        never_run = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in never_run:
                continue
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                               for a in node.names)
        graph[_module_name(path)] = {t for t in targets if t in modules} - {_module_name(path)}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of the graph (its modules, the first repeated at the end), or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return []


def test_the_domain_has_no_import_cycle() -> None:
    graph = _domain_graph()
    assert graph.get("domain.quant.dispatch")  # the graph is read
    cycle = _cycle(graph)
    assert not cycle, "import cycle in the domain: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle_through_any_edge() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"x": {"y"}, "y": set(), "p": {"q"}, "q": {"p"}}) == ["p", "q", "p"]


# --- no import cycle anywhere -----------------------------------------------------------------------

PACKAGES = ("domain", "ports", "adapters", "app")


def _import_graph(root: pathlib.Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the project modules it imports, for every module of `packages` under `root`.

    Every `import` and `from ... import` counts, wherever it is: inside functions, and inside
    `if TYPE_CHECKING:` blocks (a type-only import is still a dependency). `import a.b` names the
    module a.b (or its longest prefix that is a module); `from a import b` names a.b when b is a
    module, else a; relative imports are resolved against the importing module's package.
    """
    paths = {
        ".".join(p.relative_to(root).with_suffix("").parts[:-1] if p.name == "__init__.py"
                 else p.relative_to(root).with_suffix("").parts): p
        for package in packages for p in sorted((root / package).rglob("*.py"))
    }
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    module = alias.name
                    while module and module not in paths:
                        module = module.rpartition(".")[0]
                    targets.add(module)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
                module = ".".join(part for part in (base, node.module or "") if part)
                targets.update(f"{module}.{a.name}" if f"{module}.{a.name}" in paths else module for a in node.names)
        graph[name] = {t for t in targets if t in paths} - {name}
    return graph


def test_the_project_has_no_import_cycle() -> None:
    graph = _import_graph()
    assert "app.composition.tables" in graph["app.bootstrap"]  # the graph is read
    cycle = _cycle(graph)
    assert not cycle, ("import cycle (TYPE_CHECKING and function-local imports count): " + " -> ".join(cycle)
                       + "; move what both sides share into a module below them, or pass it in")


def test_the_import_graph_sees_every_kind_of_import(tmp_path: pathlib.Path) -> None:
    files = {
        "app/__init__.py": "",
        "app/sub/__init__.py": "from app.sub import b\n",
        "app/sub/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from app.c import X\n"
                        "def f():\n    from . import b\n",
        "app/sub/b.py": "from ..c import Y\nimport app.sub.a as a\nimport os.path\n",
        "app/c.py": "from app.sub import a\nimport app.sub.missing\n",
    }
    for relative, text in files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    graph = _import_graph(tmp_path, ("app",))
    assert graph == {"app": set(), "app.sub": {"app.sub.b"}, "app.sub.a": {"app.c", "app.sub.b"},
                     "app.sub.b": {"app.c", "app.sub.a"}, "app.c": {"app.sub.a", "app.sub"}}
    assert _cycle(graph) == ["app.c", "app.sub", "app.sub.b", "app.c"]


def _path_to(graph: dict[str, set[str]], start: str, prefix: str) -> list[str]:
    """A chain of imports from `start` to a module under `prefix`, or []."""
    seen, queue = {start: [start]}, [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in seen:
                seen[nxt] = [*seen[node], nxt]
                if nxt == prefix or nxt.startswith(prefix + "."):
                    return seen[nxt]
                queue.append(nxt)
    return []


def test_the_benchmarks_never_import_the_cli() -> None:
    graph = _import_graph()
    bench = sorted(m for m in graph if m.startswith("app.bench"))
    assert "app.bench.engine" in bench
    chains = [" -> ".join(chain) for m in bench if (chain := _path_to(graph, m, "app.cli"))]
    assert not chains, "the benchmarks import the CLI (share through app/services instead):\n" + "\n".join(chains)
