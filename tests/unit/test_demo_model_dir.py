"""`refit demo --model DIR`: your checkpoint instead of an embedded preset, on the reference engine
(the reference model at the checkpoint's shapes, holding its weights) and on vLLM (the
transformers model as the trainer, the engine started from the directory's config.json with dummy
weights). The embedded names keep working; anything else is refused on one line."""

from __future__ import annotations

import json

import attrs
import pytest

pytest.importorskip("transformers", reason="needs transformers (the `test` extra)")

from app.cli.demo_engine import engine_settings
from app.cli.demo_modes import resolve
from app.cli.main import build_parser, main
from app.config_sections import RefitConfig
from app.services.demo_config import engine_config


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):  # type: ignore[no-untyped-def]
    from adapters.hf.fixtures import write_fixture

    root = tmp_path_factory.mktemp("demo-dir")
    return {name: write_fixture(name, root / name) for name in ("tiny-qwen3", "tiny-qwen3-moe")}


def _args(*argv: str):  # type: ignore[no-untyped-def]
    args = build_parser().parse_args(["demo", *argv])
    resolve(args, notice=lambda line: None)
    return args


def test_embedded_names_still_select_the_presets() -> None:
    assert _args("--model", "micro-dense").model == "micro-dense"
    assert engine_settings(_args("vllm")).model == "micro-moe"


def test_the_vllm_demo_on_a_directory_uses_the_hf_trainer_and_a_dummy_start(dirs) -> None:
    s = engine_settings(_args("vllm", "--model", str(dirs["tiny-qwen3"])))
    config = engine_config(s, 1.0)
    assert config.model.path == str(dirs["tiny-qwen3"])
    assert (config.actor.strategy, config.actor.hf.load_model) == ("hf", True)
    assert config.reference == RefitConfig().reference
    assert config.rollout.engine_kwargs.vllm.engine_args["load_format"] == "dummy"
    from app.bootstrap import bootstrap

    services = bootstrap(attrs.evolve(config, rollout=attrs.evolve(config.rollout, name="reference")))
    trainer = services.trainer_model()
    assert trainer.config.tie_word_embeddings and "lm_head.weight" not in dict(trainer.named_weights())
    out = services.embedded.write_checkpoint(trainer, dirs["tiny-qwen3"].parent / "written")
    assert json.loads((out / "config.json").read_text()) == json.loads((dirs["tiny-qwen3"] / "config.json").read_text())


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_the_reference_demo_runs_on_a_directory(dirs, name, capsys) -> None:
    assert main(["demo", "--model", str(dirs[name]), "--steps", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == str(dirs[name])
    assert [s["refit"]["outcome"] for s in out["steps"]] == ["live"] * 4
    bf16 = [s["mismatch"] for s in out["steps"] if s["arm"] == "BF16"]
    assert bf16 and all(m["k3_kl"] == 0 and m["mean_abs_logp_diff"] == 0 for m in bf16)


def test_the_reference_model_holds_the_checkpoints_weights(dirs) -> None:
    import torch

    from app.bootstrap import bootstrap

    services = bootstrap(overrides=[f"model.path={json.dumps(str(dirs['tiny-qwen3-moe']))}"])
    trainer = services.trainer_model()
    from adapters.hf_checkpoint.reader import HfCheckpoint

    files = dict(HfCheckpoint(dirs["tiny-qwen3-moe"]).iter_tensors())
    sent = dict(trainer.named_weights())
    assert all(torch.equal(sent[n], t) for n, t in files.items())
    assert torch.equal(sent["lm_head.weight"], files["model.embed_tokens.weight"])  # tied: a copy, then its own


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "no-such-model"], "argument --model: expected an embedded model"),
    (["--model", "."], "has no config.json"),
])
def test_a_model_that_is_neither_is_refused(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["demo", *argv])
    assert info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["procs", "2"], ["qat"], ["megatron"]])
def test_a_directory_with_a_demo_that_builds_the_embedded_model_is_refused(dirs, flag, capsys) -> None:
    assert main(["demo", "--model", str(dirs["tiny-qwen3"]), *flag]) == 2
    err = capsys.readouterr().err
    assert "--model: a checkpoint directory does not go with" in err and len(err.strip().splitlines()) == 1


def test_a_checkpoint_the_reference_engine_cannot_compute_names_the_key(dirs, tmp_path, capsys) -> None:
    import shutil

    shutil.copytree(dirs["tiny-qwen3"], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["attention_bias"] = True
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    assert main(["demo", "--model", str(tmp_path / "m"), "--steps", "0"]) != 0
    err = capsys.readouterr().err
    assert "attention_bias" in err and "refit demo vllm" in err
