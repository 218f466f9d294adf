"""What `refit plan` prints: lists and regular expressions as text (never swallowed as rich
markup), and the ignore example of docs/configuration.md doing what the page says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.cli.main import main
from tests.integration.export_models import tiny_checkpoint


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("src") / "model")


def test_the_plan_table_shows_lists_and_regexes(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "rollout.quantization.linear=FP8_BLOCK",
                 "rollout.quantization.ignore=[lm_head, 're:.*layers\\.[0-3]\\..*']"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "['lm_head', 're:.*layers\\.[0-3]\\..*']" in out  # before: rich swallowed [...] as markup


def test_the_docs_ignore_example_keeps_layer_0_in_bf16(src: Path, capsys: pytest.CaptureFixture) -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    example = next(line for line in docs.splitlines() if "rollout.quantization.ignore=" in line and "refit plan" in line)
    override = example.split('"')[1]  # the documented override, as the shell passes it
    assert main(["plan", "--json", "--model", str(src), "rollout.quantization.linear=FP8_BLOCK", override]) == 0
    formats = {t["name"]: t["format"] for t in json.loads(capsys.readouterr().out)["tensors"]}
    assert formats["model.layers.0.self_attn.q_proj.weight"] == "BF16"
    assert formats["model.layers.1.self_attn.q_proj.weight"] == "FP8_BLOCK"
