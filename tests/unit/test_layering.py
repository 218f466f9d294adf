"""The hexagon's dependency rule, enforced by reading every module's imports."""

from __future__ import annotations

import ast
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


def test_only_the_composition_root_reads_the_environment() -> None:
    readers = [
        p for pkg in ("domain", "ports", "adapters", "app") for p in _modules(pkg)
        if ("os.environ" in p.read_text() or "getenv(" in p.read_text()) and p.name != "bootstrap.py"
    ]
    assert readers == [], f"environment read outside app/bootstrap.py: {readers}"
