"""The docs the code relies on are checked against the code: every page (and anchor) the code
cites exists, docs/architecture.md's tree is the real tree, its ports table lists the ports the
code uses, and docs/plan.md has a section for every dispatch rule.

When this fails, the message names the file and the citation, module, port or rule at fault.
"""

from __future__ import annotations

import ast
import functools
import re
import unicodedata
from pathlib import Path

import pytest

from adapters.profiles import PROFILES, dispatch_for
from domain.quant.dispatch import rule_names

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
ARCHITECTURE = DOCS / "architecture.md"
LAYERS = ("domain", "ports", "adapters", "app")
CITING = (*LAYERS, "tests")
# A file outside the repository that code once cited; spelled in two parts so this file does not cite it.
GONE = "ARCHITECTURE" + ".md"
CITATION = re.compile(r"(?<![\w/.-])docs/((?:[\w-]+/)?[\w-]+\.md)(?:#([\w-]+))?")


# --- pages and anchors -------------------------------------------------------------------------


def slugify(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading: its text without markup,
    lowercased, punctuation other than '-' and '_' dropped, runs of spaces and '-' made one '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


@functools.cache
def anchors(page: str) -> frozenset[str]:
    """Every anchor of a page: each heading's slug, or its explicit `{#id}` (attr_list). Lines
    inside fenced code blocks are not headings."""
    found: set[str] = set()
    fence = None
    for line in page.splitlines():
        opened = re.match(r"^\s*(```|~~~)", line)
        if opened:
            fence = None if fence == opened.group(1) else fence or opened.group(1)
            continue
        heading = None if fence else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            text = heading.group(1)
            explicit = re.search(r"\{:?\s*#([\w-]+)[^}]*\}\s*$", text)
            found.add(explicit.group(1) if explicit else slugify(text))
    return frozenset(found)


def broken_citations(text: str, docs: Path) -> list[str]:
    """The citations in `text` of a page under `docs` that does not exist, or of an anchor that
    page does not have; and any citation of the removed design document."""
    bad = [GONE] if GONE in text else []
    for m in CITATION.finditer(text):
        page, anchor = docs / m.group(1), m.group(2)
        if not page.is_file() or (anchor is not None and anchor not in anchors(page.read_text())):
            bad.append(m.group(0))
    return bad


def _sources() -> list[Path]:
    return sorted(p for d in CITING for p in (ROOT / d).rglob("*.py"))


def test_code_cites_only_pages_inside_the_repository() -> None:
    bad = {p.relative_to(ROOT).as_posix(): b for p in _sources() if (b := broken_citations(p.read_text(), DOCS))}
    assert not bad, f"citations of pages or anchors that do not exist: {bad}"


def test_the_citation_check_finds_what_is_missing(tmp_path: Path) -> None:
    d = "docs" + "/"  # not a citation of this file's own
    (tmp_path / "guide.md").write_text("# Guide\n\n## Step one: `refit plan`\n\n```console\n# not a heading\n```\n"
                                       "### Errors {#errors-here}\n")
    assert anchors((tmp_path / "guide.md").read_text()) == {"guide", "step-one-refit-plan", "errors-here"}
    ok = f"see {d}guide.md, {d}guide.md#step-one-refit-plan and {d}guide.md#errors-here"
    assert broken_citations(ok, tmp_path) == []
    bad = f"{d}missing.md; {d}guide.md#not-a-heading; ({d}guide.md#not-a-heading-either); {GONE} section 4"
    assert broken_citations(bad, tmp_path) == [GONE, f"{d}missing.md", f"{d}guide.md#not-a-heading",
                                               f"{d}guide.md#not-a-heading-either"]
    assert slugify("verl's rollout-correction metrics") == "verls-rollout-correction-metrics"
    assert slugify("Kernel backends (backend policy)") == "kernel-backends-backend-policy"


# --- the architecture page's tree ------------------------------------------------------------


# The tree's description column: an entry (a directory or files) starts left of it, a line that
# starts at it continues the entry above.
DESCRIPTION_COLUMN = 32
TREE_FILE = re.compile(r"(?<![\w/.<>-])((?:\w+/)*\w+\.py)\b")


def tree_block(page: str) -> str:
    """The ```text block under `## The tree`."""
    after = page.split("\n## The tree\n", 1)[1]
    found = re.search(r"```text\n(.*?)```", after, re.S)
    if found is None:
        raise ValueError("docs/architecture.md: no ```text block under '## The tree'")
    return found.group(1)


def tree_modules(block: str) -> set[str]:
    """Every module path the tree names. An entry line's directory (`vllm/`) nests under the
    nearest less indented directory above it; a file name (`engine.py`, `sglang/staging.py`) on an
    entry line, or on the lines continuing it, is relative to that entry's directory (for a file
    entry, its parent's). Template names (`<engine>/profile.py`) are not module paths."""
    stack: list[tuple[int, str]] = []
    where = ""
    named: set[str] = set()
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent < DESCRIPTION_COLUMN:
            while stack and stack[-1][0] >= indent:
                stack.pop()
            parent = stack[-1][1] if stack else ""
            first = line.split()[0]
            if first.endswith("/") and "<" not in first:
                stack.append((indent, parent + first))
                where = parent + first
            else:
                where = parent
        named |= {where + m.group(1) for m in TREE_FILE.finditer(line)}
    return named


def page_paths(page: str) -> set[str]:
    """The module paths written out in full anywhere on the page (`adapters/vllm/engine.py`)."""
    return set(re.findall(rf"(?<![\w/])((?:{'|'.join(LAYERS)})/[\w/]+\.py)", page))


def modules(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for layer in LAYERS for p in (root / layer).rglob("*.py")
            if p.name != "__init__.py"}


def test_the_architecture_tree_names_every_module_and_only_modules_that_exist() -> None:
    page = ARCHITECTURE.read_text()
    named = tree_modules(tree_block(page))
    unnamed = sorted(modules(ROOT) - named)
    assert not unnamed, f"docs/architecture.md's tree does not name: {', '.join(unnamed)}"
    missing = sorted(p for p in named | page_paths(page) if not (ROOT / p).is_file())
    assert not missing, f"docs/architecture.md names modules that do not exist: {', '.join(missing)}"


def test_the_tree_check_reads_the_pages_format() -> None:
    block = (
        "domain/                         pure\n"
        "  quant/                        formats\n"
        "    rules.py  model_rules.py    the checks\n"
        "    codecs/                     one module per family\n"
        "      mx.py                     MX\n"
        "  refit/                        the refit (buckets.py,\n"
        "                                sub/deep.py)\n"
        "adapters/\n"
        "  <engine>/profile.py           every engine's (engine_start.py)\n"
        "  vllm/                         adapter (engine.py)\n"
    )
    assert tree_modules(block) == {
        "domain/quant/rules.py", "domain/quant/model_rules.py", "domain/quant/codecs/mx.py",
        "domain/refit/buckets.py", "domain/refit/sub/deep.py", "adapters/engine_start.py", "adapters/vllm/engine.py",
    }


# --- the ports table ---------------------------------------------------------------------------


def ports_table(page: str) -> list[str]:
    """The first column of the table under `## The ports`."""
    section = page.split("\n## The ports\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE)


def port_classes() -> dict[str, str]:
    """Every Protocol class defined in ports/, by name -> its module (`ports.rollout_engine`)."""
    found = {}
    for path in sorted((ROOT / "ports").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and any(getattr(b, "id", None) == "Protocol" for b in node.bases):
                found[node.name] = f"ports.{path.stem}"
    return found


def imported_names(outside: tuple[str, ...] = ("domain", "adapters", "app")) -> set[tuple[str, str]]:
    """(module, name) for every `from ports.X import Name` in the code outside ports/, function-
    local imports included."""
    found = set()
    for layer in outside:
        for path in (ROOT / layer).rglob("*.py"):
            text = path.read_text()
            if "from ports." not in text:
                continue
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ports."):
                    found |= {(node.module, a.name) for a in node.names}
    return found


def test_the_ports_table_lists_the_ports_the_code_uses() -> None:
    listed = ports_table(ARCHITECTURE.read_text())
    classes = port_classes()
    used = {name for name, module in classes.items() if (module, name) in imported_names()}
    assert len(listed) > 5 and len(used) > 5  # the table and the imports were read
    not_ports = sorted(set(listed) - set(classes))
    assert not not_ports, f"docs/architecture.md's ports table lists what is no port in ports/: {not_ports}"
    unused = sorted(set(listed) - used)
    assert not unused, f"docs/architecture.md lists ports no module outside ports/ imports: {unused}"
    unlisted = sorted(used - set(listed))
    assert not unlisted, f"docs/architecture.md's ports table lacks ports the code uses: {unlisted}"
    idle = sorted(set(classes) - used)
    assert not idle, f"ports/ defines ports no module outside ports/ imports: {idle}"


# --- the dispatch rules ------------------------------------------------------------------------


@pytest.mark.parametrize("engine", sorted(PROFILES))
def test_every_dispatch_rule_has_its_section_in_the_plan_page(engine: str) -> None:
    sections = anchors((DOCS / "plan.md").read_text())
    names = rule_names(dispatch_for(engine))
    assert len(names) == len(set(names)), f"two rules share a name: {names}"
    missing = [n for n in names if n.lower() not in sections]
    assert not missing, f"docs/plan.md has no section (### NAME) for the dispatch rules: {missing}"


def test_every_worker_call_has_its_row_in_the_engines_page() -> None:
    """docs/engines.md's table of the vLLM worker calls names every request record's method and
    the record itself (adapters.vllm.protocol.REQUESTS), and no method that is not one."""
    import re

    from adapters.vllm import protocol as p

    page = (DOCS / "engines.md").read_text()
    missing = [k.METHOD for k in p.REQUESTS if f"`{k.METHOD}`" not in page or f"`{k.__name__}" not in page]
    assert not missing, f"docs/engines.md has no row for {missing}"
    named = set(re.findall(r"`(rl_refit_[a-z_]+)`", page))
    assert named <= {k.METHOD for k in p.REQUESTS} | {"rl_refit_count_layers"}, named  # the page's own example
