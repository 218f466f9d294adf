"""The Hugging Face trainer adapters (adapters.hf) against transformers itself: the names and
values a live model yields are the files `save_pretrained` writes (fused experts split per expert,
a tied head left out), the directory source reads one tensor at a time, and both score tokens as
the model's own forward does."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (the `test` extra)")

from safetensors import safe_open

from adapters.hf.checkpoint import HfCheckpointTrainer
from adapters.hf.fixtures import write_fixture
from adapters.hf.module import HfModuleTrainer
from adapters.hf_checkpoint.reader import HfCheckpoint

NAMES = ("tiny-qwen3", "tiny-qwen3-moe")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("hf-trainer")
    return {name: write_fixture(name, root / name) for name in NAMES}


def _files(path) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return tensors


@pytest.mark.parametrize("name", NAMES)
def test_a_live_model_yields_what_save_pretrained_writes(dirs, name, tmp_path) -> None:
    trainer = HfModuleTrainer.from_pretrained(dirs[name])
    named = list(trainer.named_weights())
    trainer.model.save_pretrained(str(tmp_path))
    files = _files(tmp_path)
    assert [n for n, _ in named] and sorted(n for n, _ in named) == sorted(files)
    assert all(torch.equal(t, files[n]) for n, t in named)
    assert "lm_head.weight" not in files  # tied: transformers writes no head
    if name == "tiny-qwen3-moe":
        assert "model.layers.0.mlp.experts.3.up_proj.weight" in files


@pytest.mark.parametrize("name", NAMES)
def test_the_directory_source_streams_the_files_tensors_one_at_a_time(dirs, name) -> None:
    reads: list[int] = []
    trainer = HfCheckpointTrainer(HfCheckpoint(dirs[name], on_read=reads.append))
    stream = trainer.named_weights()
    assert reads == []  # nothing read before the stream asks
    first_name, _ = next(stream)
    assert len(reads) == 1 and first_name == "model.embed_tokens.weight"
    rest = list(stream)
    assert len(reads) == len(rest) + 1
    files = _files(dirs[name])
    live = dict(HfModuleTrainer.from_pretrained(dirs[name]).named_weights())
    assert {first_name, *(n for n, _ in rest)} == set(files) == set(live)
    assert all(torch.equal(t, live[n]) for n, t in rest)
    assert trainer.num_bytes() == sum(t.numel() * t.element_size() for t in files.values())


def test_a_tied_checkpoint_that_keeps_a_head_copy_does_not_send_it(dirs, tmp_path) -> None:
    from safetensors.torch import save_file

    files = _files(dirs["tiny-qwen3"])
    files["lm_head.weight"] = files["model.embed_tokens.weight"].clone()
    save_file(files, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((dirs["tiny-qwen3"] / "config.json").read_text())
    trainer = HfCheckpointTrainer.open(tmp_path)
    assert trainer.tied and "lm_head.weight" not in dict(trainer.named_weights())
    config = json.loads((tmp_path / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    untied = HfCheckpointTrainer.open(tmp_path)
    assert not untied.tied and "lm_head.weight" in dict(untied.named_weights())


@pytest.mark.parametrize("name", NAMES)
def test_log_probs_are_the_models_own_forward_and_both_sources_agree(dirs, name) -> None:
    module = HfModuleTrainer.from_pretrained(dirs[name])
    ids = torch.randint(0, 512, (2, 7), generator=torch.Generator().manual_seed(1))
    logp, entropy = module.log_probs(ids)
    with torch.no_grad():
        ref = torch.log_softmax(module.model(input_ids=ids).logits.float()[:, :-1], dim=-1)
    # the fused path reduces in another order than log_softmax: equal up to fp32 rounding
    assert torch.allclose(logp, ref.gather(-1, ids[:, 1:, None])[..., 0], rtol=0, atol=1e-5)
    assert torch.allclose(entropy, -(ref.exp() * ref).sum(-1), rtol=0, atol=1e-5)
    streamed = HfCheckpointTrainer.open(dirs[name]).log_probs(ids)
    assert torch.equal(streamed[0], logp) and torch.equal(streamed[1], entropy)


def test_the_demos_steps_move_every_parameter_and_restore_puts_them_back(dirs, tmp_path) -> None:
    trainer = HfModuleTrainer.from_pretrained(dirs["tiny-qwen3-moe"])
    start = trainer.snapshot()
    trainer.perturb_(7, 0.02)
    moved = {n: not torch.equal(p, start[n]) for n, p in trainer.model.named_parameters()}
    assert all(moved.values()), [n for n, m in moved.items() if not m]
    assert trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight  # still tied
    saved = _files(trainer.save(tmp_path))
    assert sorted(saved) == sorted(n for n, _ in trainer.named_weights())
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((dirs["tiny-qwen3-moe"] / "config.json").read_text())
    trainer.restore_(start)
    assert all(torch.equal(p, start[n]) for n, p in trainer.model.named_parameters())


def test_a_directory_that_is_no_checkpoint_is_named(tmp_path) -> None:
    from domain.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"no config\.json"):
        HfModuleTrainer.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        HfCheckpointTrainer.open(tmp_path / "missing")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_never_make_the_logits(dirs, temperature) -> None:
    module = HfModuleTrainer.from_pretrained(dirs["tiny-qwen3"])
    ids = torch.randint(0, 512, (3, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # the materialized computation, before the hook goes on
        ref = torch.log_softmax(module.model(input_ids=ids).logits.float()[:, :-1] / temperature, dim=-1)
    vocab = module.config.vocab_size
    made: list[tuple[int, ...]] = []
    hook = module.model.lm_head.register_forward_hook(lambda mod, args, out: made.append(tuple(out.shape)))

    class Shapes(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dim() >= 3 and out.shape[-1] == vocab:
                made.append(tuple(out.shape))
            return out

    try:
        with Shapes():
            logp, entropy = module.log_probs(ids, temperature=temperature)
    finally:
        hook.remove()
    assert made == []  # no [B, T, V] tensor, and the head's forward never ran
    assert torch.allclose(logp, ref.gather(-1, ids[:, 1:, None])[..., 0], rtol=0, atol=1e-5)
    assert torch.allclose(entropy, -(ref.exp() * ref).sum(-1), rtol=0, atol=1e-5)


def test_a_model_with_soft_capped_logits_is_scored_from_its_logits(dirs) -> None:
    module = HfModuleTrainer.from_pretrained(dirs["tiny-qwen3"])
    module.model.config.final_logit_softcapping = 30.0  # the fused path cannot apply it
    calls: list[int] = []
    hook = module.model.lm_head.register_forward_hook(lambda mod, args, out: calls.append(1))
    try:
        module.log_probs(torch.randint(0, 512, (1, 5), generator=torch.Generator().manual_seed(3)))
    finally:
        hook.remove()
    assert calls == [1]
