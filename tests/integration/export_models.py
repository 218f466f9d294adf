"""Tiny Hugging Face checkpoints built locally (no downloads), compressed-tensors decompression,
and what the export and CLI tests read back: a directory's entries, a command's one error line."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

TOKENIZER_FILES = {
    "tokenizer_config.json": {"model_max_length": 128, "tokenizer_class": "PreTrainedTokenizerFast"},
    "special_tokens_map.json": {"eos_token": "<eos>"},
}


def tiny_checkpoint(directory: Path, layers: int = 2, *, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A tiny Qwen3-MoE-like safetensors checkpoint written directly (no transformers): q/k/v/o,
    a router, two experts per layer, embeddings, a norm and lm_head; a config.json and a
    tokenizer file."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    tensors = {"model.embed_tokens.weight": torch.randn(64, 64, generator=g),
               "lm_head.weight": torch.randn(64, 64, generator=g), "model.norm.weight": torch.ones(64)}
    for layer in range(layers):
        p = f"model.layers.{layer}"
        for proj, rows in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32), ("o_proj", 64)):
            tensors[f"{p}.self_attn.{proj}.weight"] = torch.randn(rows, 64, generator=g)
        tensors[f"{p}.mlp.gate.weight"] = torch.randn(2, 64, generator=g)
        for e in range(2):
            for proj, shape in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32))):
                tensors[f"{p}.mlp.experts.{e}.{proj}.weight"] = torch.randn(*shape, generator=g)
    directory.mkdir(parents=True)
    save_file({k: v.to(dtype) for k, v in tensors.items()}, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": layers,
                                                       "torch_dtype": str(dtype).removeprefix("torch.")}))
    (directory / "tokenizer_config.json").write_text("{}")
    return directory


def save_tiny_model(directory: Path, *, moe: bool, layers: int = 2, seed: int = 0) -> Path:
    """A randomly initialised Qwen3 (dense) or Qwen3-MoE model, saved with save_pretrained in BF16."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32,
                                                   num_experts=4, num_experts_per_tok=2))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, intermediate_size=128))
    with torch.no_grad():
        for p in model.parameters():  # make scales differ between tensors and experts
            p.mul_(1 + torch.rand(()) * 4)
    model.to(torch.bfloat16).save_pretrained(directory)
    for name, content in TOKENIZER_FILES.items():
        (directory / name).write_text(json.dumps(content))
    return directory


def decompress_with_model_compressor(quantization_config: dict, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Load an exported state dict into a module tree compressed-tensors builds from the config, and
    decompress it with ModelCompressor. Strict loading checks every name, shape and dtype.

    Returns:
        module name -> decompressed weight, for every module compressed-tensors quantized.
    """
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig

    from adapters.compressed_tensors.quantization_config import attach_schemes

    qc = QuantizationConfig.model_validate(quantization_config)
    root = nn.Module()

    def module_at(path: str) -> nn.Module:
        m = root
        for part in path.split(".") if path else []:
            if not hasattr(m, part):
                m.add_module(part, nn.Module())
            m = getattr(m, part)
        return m

    linears: dict[str, tuple[int, int, torch.dtype]] = {}
    for name, t in state_dict.items():
        mod, _, local = name.rpartition(".")
        if local in ("weight", "weight_packed") and t.dim() == 2 and "embed" not in mod:
            n, k = t.shape
            linears[mod] = (n, k * 2 if local == "weight_packed" else k, t.dtype)
    for mod, (n, k, dtype) in linears.items():
        parent, _, leaf = mod.rpartition(".")
        module_at(parent).add_module(leaf, nn.Linear(k, n, bias=False, dtype=torch.bfloat16 if dtype.is_floating_point and dtype.itemsize == 2 else torch.float32))
    for name, t in state_dict.items():
        mod, _, local = name.rpartition(".")
        if mod not in linears:
            module_at(mod).register_parameter(local, nn.Parameter(torch.empty_like(t), requires_grad=False))
    attach_schemes(root, qc)
    compressor = ModelCompressor(quantization_config=qc)
    compressor.compress_model(root)
    expected = root.state_dict()
    wrong = {k: (tuple(expected[k].shape), expected[k].dtype, tuple(t.shape), t.dtype)
             for k, t in state_dict.items() if k in expected and (expected[k].shape != t.shape or expected[k].dtype != t.dtype)}
    if set(expected) != set(state_dict) or wrong:
        raise AssertionError(f"layout differs from compressed-tensors': extra {sorted(set(state_dict) - set(expected))[:5]}, "
                             f"missing {sorted(set(expected) - set(state_dict))[:5]}, wrong {list(wrong.items())[:3]}")
    root.load_state_dict(state_dict, strict=True)
    quantized = [n for n, m in root.named_modules() if getattr(m, "quantization_scheme", None) is not None]
    compressor.decompress_model(root)
    return {n: root.get_submodule(n).weight.detach() for n in quantized}


def tree(path: Path) -> dict[str, bytes | str]:
    """Every entry under `path` (symlinks by target, directories as "/"), with file bytes."""
    out: dict[str, bytes | str] = {}
    for p in sorted(path.rglob("*")):
        out[str(p.relative_to(path))] = os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else "/"
    return out


def one_line(capsys: pytest.CaptureFixture, *words: str) -> str:
    """The one line a refused command printed on stderr, holding every word (no traceback)."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    for w in words:
        assert w in err[0], (w, err[0])
    return err[0]


def model_dir(directory: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    """A checkpoint directory of `tensors` (one safetensors file) and a Qwen3 config.json."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3", **(config or {})}))
    return directory


def copy_model(src: Path, dst: Path, **edit: Callable[[Path], None]) -> Path:
    """A copy of the model directory `src`, each file named by a keyword (`config__json` for
    config.json) changed by its function."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    for name, change in edit.items():
        change(dst / name.replace("__", "."))
    return dst


def gptq_model(t: Path, bits: int = 4, **tensors: torch.Tensor) -> str:
    """A checkpoint whose config says GPTQ (`bits`, group size 128), holding `tensors` for q_proj."""
    config = {"quantization_config": {"quant_method": "gptq", "bits": bits, "group_size": 128}}
    q = "model.layers.0.self_attn.q_proj"
    stored = {"lm_head.weight": torch.randn(64, 128).bfloat16(), **{f"{q}.{k}": v for k, v in tensors.items()}}
    return str(model_dir(t / "gptq", stored, config))


def gptq_4bit() -> dict[str, torch.Tensor]:
    """q_proj as GPTQ 4-bit stores it: K = 128 packed 8 to an int32 along K, N = 256; one group."""
    return {"qweight": torch.zeros(16, 256, dtype=torch.int32), "qzeros": torch.zeros(1, 32, dtype=torch.int32),
            "scales": torch.ones(1, 256).half(), "g_idx": torch.zeros(128, dtype=torch.int32)}
