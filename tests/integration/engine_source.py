"""Static analysis of an engine's source (a downloaded wheel, or a directory copy of it).

`check_uses(source, uses)` resolves every entry of an adapter's `api.USES` manifest in the
source by reading its syntax trees (nothing is imported or run) and returns the problems found.
A mutated copy is the same Source with some files' text replaced (`overrides`).
`fetch_wheel` downloads a pinned wheel once (`pip download --no-deps`) into a cache directory.
"""

from __future__ import annotations

import ast
import fcntl
import pathlib
import subprocess
import sys
import zipfile
from collections.abc import Iterable


def fetch_wheel(package: str, version: str, cache: pathlib.Path, timeout: float = 600) -> pathlib.Path:
    """The cached wheel of package==version, downloaded first when missing.

    Raises RuntimeError with pip's output when the download fails (e.g. no registry).
    """
    cache.mkdir(parents=True, exist_ok=True)
    pattern = f"{package.replace('-', '_')}-{version}-*.whl"
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # pytest-xdist workers share the cache
        found = sorted(cache.glob(pattern))
        if not found:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   f"{package}=={version}", "-d", str(cache)]
            try:
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            except subprocess.TimeoutExpired as err:
                raise RuntimeError(f"pip download {package}=={version} timed out") from err
            found = sorted(cache.glob(pattern))
            if run.returncode != 0 or not found:
                raise RuntimeError(f"pip download {package}=={version} failed: {(run.stderr or run.stdout)[-600:]}")
    return found[0]


class Source:
    """Python files of a package, from a wheel (zip) or a directory holding the package."""

    def __init__(self, root: pathlib.Path, overrides: dict[str, str] | None = None) -> None:
        self.root = root
        self.overrides = dict(overrides or {})  # relative path -> replacement text (mutations)
        self._zip = zipfile.ZipFile(root) if root.suffix == ".whl" else None
        self._trees: dict[str, ast.Module | None] = {}
        self._texts: dict[str, str] = {}

    def _read(self, rel: str) -> str | None:
        if rel in self.overrides:
            return self.overrides[rel]
        if self._zip is not None:
            try:
                return self._zip.read(rel).decode()
            except KeyError:
                return None
        path = self.root / rel
        return path.read_text() if path.is_file() else None

    def text(self, module: str) -> str | None:
        if module not in self._texts:
            base = module.replace(".", "/")
            found = self._read(base + ".py")
            self._texts[module] = found if found is not None else (self._read(base + "/__init__.py") or "")
        return self._texts[module] or None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            text = self.text(module)
            self._trees[module] = ast.parse(text) if text is not None else None
        return self._trees[module]

    def is_package(self, module: str) -> bool:
        return self._read(module.replace(".", "/") + "/__init__.py") is not None


def _absolute(module: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_pkg else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _find(src: Source, module: str, name: str, depth: int = 4) -> tuple[str, ast.AST] | None:
    """The def/class/assignment binding `name` in `module`, following `from x import name`."""
    tree = src.tree(module)
    if tree is None or depth == 0:
        return None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return module, node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return module, node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return module, node
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    found = _find(src, _absolute(module, node, src.is_package(module)), alias.name, depth - 1)
                    if found:
                        return found
    return None


def _lazy_exports(tree: ast.Module) -> set[str]:
    """Names a package exports lazily: `__all__` entries and string keys of module-level dicts."""
    names: set[str] = set()
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, (ast.List, ast.Tuple)):
            names.update(e.value for e in value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str))
        if isinstance(value, ast.Dict):
            names.update(k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return names


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[set[str], bool]:
    a = fn.args
    names = {x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)}
    return names, a.kwarg is not None


def _class_names(cls: ast.ClassDef) -> set[str]:
    """Fields, methods, class attributes, `self.x` assignments and __init__ parameters."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
            if node.name == "__init__":
                names |= _params(node)[0] - {"self"}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
    return names


def _member(src: Source, module: str, cls: ast.ClassDef, attr: str, depth: int = 4) -> ast.AST | bool | None:
    """The method def named attr (or True for a field) on cls or its bases."""
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == attr:
            return node
    if attr in _class_names(cls):
        return True
    if depth == 0:
        return None
    for base in cls.bases:
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
        found = _find(src, module, name) if name else None
        if found and isinstance(found[1], ast.ClassDef):
            hit = _member(src, found[0], found[1], attr, depth - 1)
            if hit is not None:
                return hit
    return None


def _accepts(src: Source, module: str, node: ast.AST, kwargs: Iterable[str]) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        names, open_kw = _params(node)
        return [] if open_kw else [k for k in kwargs if k not in names]
    if isinstance(node, ast.ClassDef):
        return [k for k in kwargs if _member(src, module, node, k) is None]
    return list(kwargs)


def _check(src: Source, kind: str, target: str, details: tuple[str, ...]) -> str | None:
    module, _, qual = target.partition(":")
    tree = src.tree(module)
    if tree is None:
        return f"{target}: module {module} not found"
    head, _, attr = qual.partition(".")
    if kind == "symbol":
        found = _find(src, module, qual)
        if found is None:
            return None if qual in _lazy_exports(tree) and not details else f"{target}: not defined"
        missing = _accepts(src, found[0], found[1], details)
        return f"{target}: no keyword {missing}" if missing else None
    if kind in ("member", "contains"):
        found = _find(src, module, head)
        if found is None or not isinstance(found[1], (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            return f"{target}: {head} not defined"
        node: ast.AST | bool | None = found[1]
        if attr:
            node = _member(src, found[0], found[1], attr) if isinstance(found[1], ast.ClassDef) else None
            if node is None:
                return f"{target}: no member {attr!r}"
        if kind == "member":
            missing = _accepts(src, found[0], node, details) if details and not isinstance(node, bool) else []
            return f"{target}: no keyword {missing}" if missing else None
        text = ast.get_source_segment(src.text(found[0]) or "", node) if isinstance(node, ast.AST) else ""
        absent = [s for s in details if s not in (text or "")]
        return f"{target}: source no longer contains {absent}" if absent else None
    if kind == "env":
        keys = {k.value for n in ast.walk(tree) if isinstance(n, ast.Dict)
                for k in n.keys if isinstance(k, ast.Constant)}
        return None if qual in keys else f"{target}: environment variable not read"
    if kind == "values":
        found = _find(src, module, qual)
        if found is None:
            return f"{target}: not defined"
        consts = {n.value for n in ast.walk(found[1]) if isinstance(n, ast.Constant)}
        missing = [v for v in details if v not in consts]
        return f"{target}: missing values {missing}" if missing else None
    if kind == "field":
        fields = {n.target.id for n in ast.walk(tree)
                  if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        return None if qual in fields else f"{target}: no such field"
    return f"{target}: unknown kind {kind!r}"


def check_uses(src: Source, uses: Iterable[tuple[str, str, tuple[str, ...]]]) -> list[str]:
    """Every problem found resolving the manifest entries (empty when all exist)."""
    return [p for kind, target, details in uses if (p := _check(src, kind, target, details))]


def adapter_imports(package_dir: pathlib.Path, engine: str) -> set[str]:
    """`module:name` of every `from <engine>... import name` in an adapter package."""
    found: set[str] = set()
    for path in sorted(package_dir.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                    (node.module == engine or node.module.startswith(engine + ".")):
                found.update(f"{node.module}:{a.name}" for a in node.names)
    return found
