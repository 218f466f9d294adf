"""Every `refit plan` example of docs/plan.md is run, and the first line it prints (stdout, or
the one error line on stderr) is the line the page shows under it. The page's models are written
here: `./tiny-qwen3-moe` (transformers' Qwen3-MoE at test shapes) and `./deepseek-v4-fp8` (the same
weights, a DeepSeek-V4 config with its native FP8 quantization_config); its YAML files come from
the page's yaml blocks (first line `# NAME.yaml`)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from app.cli.main import main

pytest.importorskip("transformers", reason="the page's models are written with transformers (the `test` extra)")

PAGE = Path(__file__).resolve().parents[2] / "docs" / "plan.md"
V4_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}


def _blocks(kind: str) -> list[list[str]]:
    return [b.splitlines() for b in re.findall(rf"^ *```{kind}\n(.*?)^ *```", PAGE.read_text(), re.M | re.S)]


def _examples() -> list[tuple[str, str]]:
    """(command, the line the page shows under it) for every `$ refit plan` line with output."""
    out = []
    for block in _blocks("console"):
        lines = [line.strip() for line in block]
        for i, line in enumerate(lines):
            if not line.startswith("$ ") or "refit plan" not in line:
                continue
            if "[" in line and (i + 1 == len(lines) or lines[i + 1].startswith("$")):
                continue  # the synopsis, `refit plan [CONFIG] ...`
            out.append((line[2:], lines[i + 1]))
    return out


EXAMPLES = _examples()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from adapters.hf.fixtures import write_fixture

    root = tmp_path_factory.mktemp("plan-page")
    moe = write_fixture("tiny-qwen3-moe", root / "tiny-qwen3-moe")
    v4 = root / "deepseek-v4-fp8"
    shutil.copytree(moe, v4)
    config = json.loads((v4 / "config.json").read_text())
    config.update(model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], quantization_config=V4_FP8)
    (v4 / "config.json").write_text(json.dumps(config))
    for block in _blocks("yaml"):
        if block and re.fullmatch(r"# [\w.-]+\.yaml", block[0].strip()):
            (root / block[0].strip()[2:]).write_text("\n".join(block[1:]) + "\n")
    return root


def test_the_page_has_its_examples() -> None:
    commands = " ".join(c for c, _ in EXAMPLES)
    assert len(EXAMPLES) >= 7, EXAMPLES
    for part in ("--model ./tiny-qwen3-moe", "rollout.name=sglang", "verl-dotted.yaml", "VERL_FUSED_USE_OP_HOOK=",
                 "VERL_ROLLOUT_USE_DEEP_GEMM="):
        assert part in commands


@pytest.mark.parametrize(("command", "first_line"), EXAMPLES, ids=[c[:60] for c, _ in EXAMPLES])
def test_each_example_prints_the_first_line_the_page_shows(command: str, first_line: str, workdir: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    words = shlex.split(command)
    while "=" in words[0]:  # VAR=value before the command
        name, _, value = words.pop(0).partition("=")
        monkeypatch.setenv(name, value)
    for name in ("VERL_FUSED_USE_OP_HOOK", "VERL_ROLLOUT_USE_DEEP_GEMM"):
        if name not in command:
            monkeypatch.delenv(name, raising=False)
    assert words[:2] == ["refit", "plan"], command
    monkeypatch.chdir(workdir)
    code = main(words[1:])
    out, err = capsys.readouterr()
    printed = (out if code == 0 else err).splitlines()
    assert printed, f"{command!r} printed nothing (exit {code}); stderr: {err}"
    assert printed[0] == first_line
    assert code == (0 if first_line.startswith("refit plan: checked ") else 2)
