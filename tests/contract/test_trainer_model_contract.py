"""Contract of the TrainerModel port, run against the reference trainer, the embedded trainable
module's trainer view, the Megatron-Core adapter (a real GPTModel on CPU), and the Hugging Face
adapters (a live transformers Qwen3 and Qwen3-MoE, and a checkpoint directory streamed).

Every implementation yields unique Hugging Face names in layer order with full tensors, and
scores tokens the same way: log-probs <= 0 and entropies >= 0 of shape [B, T - 1], float32, that
agree with a softmax over the model's own logits and react to the temperature.
"""

from __future__ import annotations

import re

import pytest
import torch

from adapters.qat_reference.embedded import EmbeddedModule
from adapters.reference.config import MICRO_MOE
from adapters.reference.trainer import ReferenceTrainer

TRAINERS = ("reference", "embedded-module", "megatron", "hf-module", "hf-module-moe", "hf-checkpoint")
VOCAB = {"reference": MICRO_MOE.vocab_size, "embedded-module": MICRO_MOE.vocab_size, "megatron": 64,
         "hf-module": 512, "hf-module-moe": 512, "hf-checkpoint": 512}


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):  # type: ignore[no-untyped-def]
    """The tiny fixtures (tied Qwen3, tied Qwen3-MoE), written once by transformers."""
    pytest.importorskip("transformers", reason="needs transformers (the `test` extra)")
    from adapters.hf.fixtures import write_fixture

    root = tmp_path_factory.mktemp("hf")
    return {name: write_fixture(name, root / name) for name in ("tiny-qwen3", "tiny-qwen3-moe")}


@pytest.fixture(params=TRAINERS)
def trainer(request):  # type: ignore[no-untyped-def]
    kind = request.param
    request.node.vocab = VOCAB[kind]
    if kind.startswith("hf-"):
        from adapters.hf.checkpoint import HfCheckpointTrainer
        from adapters.hf.module import HfModuleTrainer

        dirs = request.getfixturevalue("hf_dirs")
        if kind == "hf-checkpoint":
            yield HfCheckpointTrainer.open(dirs["tiny-qwen3-moe"])
        else:
            yield HfModuleTrainer.from_pretrained(dirs["tiny-qwen3-moe" if kind == "hf-module-moe" else "tiny-qwen3"])
    elif kind == "reference":
        yield ReferenceTrainer.from_seed(MICRO_MOE, 0)
    elif kind == "embedded-module":
        yield EmbeddedModule.from_seed(MICRO_MOE, 0).trainer()
    else:
        pytest.importorskip("megatron.core", reason="needs megatron-core (the `megatron` extra)")
        from adapters.megatron.trainer_model import MegatronTrainerModel
        from domain.forward.mode import FusedForwardMode
        from tests.megatron_cpu import megatron_cpu, tiny_gpt_model

        with megatron_cpu():
            model = tiny_gpt_model(tied=False, num_layers=2, num_query_groups=2, gated_linear_unit=True)
            yield MegatronTrainerModel.build(model, FusedForwardMode.LEGACY)


def _ids(vocab: int, batch: int = 2, seq: int = 9) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(3))


def _layer(name: str) -> int:
    m = re.search(r"\.layers\.(\d+)\.", name)
    return int(m[1]) if m else -1


def test_names_are_unique_hugging_face_names_in_layer_order(trainer) -> None:
    named = list(trainer.named_weights())
    names = [n for n, _ in named]
    assert names and len(set(names)) == len(names)
    assert all(n.startswith(("model.", "lm_head.")) for n in names), names[:5]
    layers = [_layer(n) for n in names if _layer(n) >= 0]
    assert layers == sorted(layers), "layer tensors come in layer order"
    assert all(isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0 for _, t in named)


def test_named_weights_is_repeatable_and_reads_the_current_weights(trainer) -> None:
    first = [(n, t.detach().clone()) for n, t in trainer.named_weights()]
    second = list(trainer.named_weights())
    assert [n for n, _ in first] == [n for n, _ in second]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first, second, strict=True))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_and_entropy_are_a_distribution_over_the_vocabulary(trainer, request, temperature) -> None:
    vocab = request.node.vocab
    ids = _ids(vocab)
    logp, entropy = trainer.log_probs(ids, temperature=temperature)
    assert logp.shape == entropy.shape == (2, 8)
    assert logp.dtype == entropy.dtype == torch.float32
    assert bool(torch.isfinite(logp).all()) and bool((logp <= 0).all())
    assert bool((entropy >= -1e-6).all()) and bool((entropy <= torch.log(torch.tensor(float(vocab))) + 1e-4).all())


def test_temperature_changes_the_scores_and_scoring_is_deterministic(trainer, request) -> None:
    ids = _ids(request.node.vocab)
    a, ea = trainer.log_probs(ids, temperature=1.0)
    b, _ = trainer.log_probs(ids, temperature=1.0)
    c, ec = trainer.log_probs(ids, temperature=0.5)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    assert float(ec.mean()) < float(ea.mean())  # a sharper distribution has less entropy
