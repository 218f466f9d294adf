"""The documentation covers the product: every CLI command and option, every error, every page linked.

When this fails, the message lists exactly what is missing and where it should go.
"""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path

import pytest

import adapters.vllm.errors
import domain.errors as errors
from app.cli.main import COMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CLI_PAGE = DOCS / "cli.md"
ERRORS_PAGE = DOCS / "errors.md"
INDEX = DOCS / "index.md"


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _cli_sections() -> dict[str, str]:
    """docs/cli.md split at its `## refit COMMAND` headings: command -> section text."""
    text = CLI_PAGE.read_text()
    parts = re.split(r"^## `?refit (\w[\w-]*)[^\n]*$", text, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _documented_options(parser: argparse.ArgumentParser) -> list[str]:
    """What a user can type: every long option, and the choices of positional arguments."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if action.option_strings:
            out.append(max(action.option_strings, key=len))
        elif action.choices:
            out.extend(str(c) for c in action.choices)
    return out


def test_every_command_and_option_is_in_the_cli_page() -> None:
    sections = _cli_sections()
    missing = []
    for command, parser in _subparsers().items():
        if command not in sections:
            missing.append(f"`## refit {command}` section")
            continue
        missing += [f"refit {command} {opt}" for opt in _documented_options(parser)
                    if not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", sections[command])]
    assert set(_subparsers()) == set(COMMANDS)
    assert not missing, f"docs/cli.md lacks: {', '.join(missing)}"


# Where error classes are defined: the domain's package, and the adapters that keep errors only they raise.
ERROR_MODULES = (errors, adapters.vllm.errors)


def _defined_in(cls: type, module: object) -> bool:
    name = getattr(module, "__name__", "")
    return cls.__module__ == name or cls.__module__.startswith(name + ".")


def _error_types() -> dict[str, type[errors.RefitError]]:
    return {name: cls for module in ERROR_MODULES for name, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, errors.RefitError) and _defined_in(cls, module)}


def _error_classes() -> list[str]:
    return sorted(_error_types())


def test_every_error_class_is_in_the_error_reference() -> None:
    text = ERRORS_PAGE.read_text()
    names = _error_classes()
    assert "RefitError" in names and len(names) > 10  # the introspection itself works
    missing = [n for n in names if not re.search(rf"^#+ .*\b{n}\b", text, flags=re.MULTILINE)]
    assert not missing, f"docs/errors.md has no heading naming: {', '.join(missing)}"


def test_every_page_is_linked_from_the_index() -> None:
    # docs/index.md is the site's navigation (mkdocs-literate-nav): a page missing there is hidden.
    linked = set(re.findall(r"\]\(([^)#\s]+\.md)", INDEX.read_text()))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")} - {"index.md"}
    missing = sorted(pages - linked)
    assert not missing, f"docs/index.md links none of: {', '.join(missing)}"
    dangling = sorted(p for p in linked if not (DOCS / p).exists())
    assert not dangling, f"docs/index.md links pages that do not exist: {', '.join(dangling)}"


def test_the_check_finds_what_is_missing(tmp_path: Path) -> None:
    # The section parser and the option matcher must see a gap when there is one.
    parser = argparse.ArgumentParser()
    parser.add_argument("suite", choices=["codecs", "refit"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", "-o")
    assert _documented_options(parser) == ["codecs", "refit", "--quick", "--out"]
    assert re.search(r"(?<![\w-])--out(?![\w-])", "`--output DIR`") is None


def _exit_table() -> dict[str, int]:
    """docs/errors.md's table of error classes: name -> exit status."""
    rows = re.findall(r"^\| \[`(\w+)`\]\(#\w+\) \| [^|]+ \| (\d+) \|$", ERRORS_PAGE.read_text(), flags=re.MULTILINE)
    return {name: int(code) for name, code in rows}


def _outcome_table() -> dict[str, int]:
    """docs/errors.md's table of outcomes: first words of the row -> exit status."""
    section = ERRORS_PAGE.read_text().split("## Exit status", 1)[1].split("| error | derives from", 1)[0]
    rows = re.findall(r"^\| ([^|]+) \| ([\d /]+) \|", section, flags=re.MULTILINE)
    return {label.strip(): int(code.split("/")[0]) for label, code in rows}


def _raising(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> None:
    import app.cli.plan

    def run(_args: object) -> int:
        raise exc

    monkeypatch.setattr(app.cli.plan, "run", run)


def test_every_error_is_listed_with_the_exit_status_refit_gives_it(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture) -> None:
    table = _exit_table()
    names = _error_classes()
    assert sorted(table) == sorted(names), (f"docs/errors.md's exit-status table lacks {sorted(set(names) - set(table))} "
                                            f"and lists unknown {sorted(set(table) - set(names))}")
    for name, code in table.items():
        cls = _error_types()[name]
        err = cls.__new__(cls)  # constructors differ; the CLI needs only the type and the text
        Exception.__init__(err, f"a {name}")
        _raising(monkeypatch, err)
        assert main(["plan"]) == code, name
        line = capsys.readouterr().err
        assert line == f"refit plan: {name}: a {name}\n", line


def test_the_outcome_table_matches_what_refit_does(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import signal

    from app.cli.main import Terminated

    table = _outcome_table()

    def documented(words: str) -> int:
        (code,) = [c for label, c in table.items() if words in label]
        return code

    cases = {"`ModuleNotFoundError`": ModuleNotFoundError("X needs y", name="y"), "internal error": KeyError("bug"),
             "interrupted": KeyboardInterrupt()}
    for words, exc in cases.items():
        _raising(monkeypatch, exc)
        assert main(["plan"]) == documented(words), words
    _raising(monkeypatch, Terminated(signal.SIGTERM))
    assert main(["plan"]) == 128 + signal.SIGTERM
    assert main(["plan", "--no-such-option"]) == documented("bad command line")
    assert documented("success") == 0 and documented("any error in the table below") == 2
    capsys.readouterr()
