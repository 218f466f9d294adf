"""The embedded reference model is a Qwen3 / Qwen3-MoE: transformers loads the checkpoint the
composition root writes for an engine, every tensor strictly, and computes the same logits as the
reference model's own forward, to BF16 rounding (the two forwards round in other places). The
bound is on the mean difference relative to the logits' spread: about 8e-4 here, while a config
that describes another model (top-k weights not renormalised, another rope base, no dense first
layer) measures 2.6e-3 to 8e-3."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the reference is transformers' own Qwen3 implementation")

from transformers import AutoModelForCausalLM

from adapters.reference.config import preset
from adapters.reference.hf import hf_config, write_checkpoint
from adapters.reference.model import forward_logits
from adapters.reference.trainer import ReferenceTrainer


@pytest.mark.parametrize("name", ["micro-dense", "micro-moe"])
def test_transformers_serves_the_reference_model(name: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = preset(name)
    trainer = ReferenceTrainer.from_seed(cfg, 3)
    directory = write_checkpoint(cfg, trainer.named_weights(), tmp_path)
    model, info = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
    assert model.config.model_type == hf_config(cfg)["model_type"]
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = model(ids).logits.float()
    ours = forward_logits(cfg, trainer.weights, ids).float()
    spread = ours.std()
    assert (theirs - ours).abs().mean() / spread < 1.5e-3
    assert (theirs - ours).abs().max() / spread < 0.03
