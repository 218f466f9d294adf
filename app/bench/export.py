"""`refit bench export`: streaming export of a ~0.5 GB BF16 checkpoint (built here, no downloads)
against compressed-tensors' own ModelCompressor path on the same checkpoint, in the same run.

Each path runs in a fresh child process so that its peak resident memory (VmHWM, reset after the
imports) is its own. Reported: wall time, source MB/s, peak RSS above the post-import baseline,
the largest fused group (the only tensors the streaming exporter must hold together), and both
as a share of the checkpoint size.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from app.bench.child import run_reporting, typed_error
from app.bench.memory import process_kib, reset_peak_rss
from app.bench.report import BenchReport

FULL: dict[str, Any] = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=16, vocab_size=32000,
            num_attention_heads=16, num_key_value_heads=8, head_dim=64)
QUICK: dict[str, Any] = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, vocab_size=8192,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64)
PRESET = "NVFP4"


def build_checkpoint(directory: Path, dims: dict[str, Any], seed: int = 0) -> int:
    """Write a random BF16 Qwen3 checkpoint tensor by tensor (config.json from transformers' Qwen3Config).

    Returns:
        Checkpoint bytes.
    """
    from transformers import Qwen3Config

    from adapters.hf_checkpoint.writer import CheckpointWriter
    from domain.quant.stream import TensorSpec

    config = Qwen3Config(**dims, tie_word_embeddings=False, dtype="bfloat16")
    h, inter, heads, kv, hd = dims["hidden_size"], dims["intermediate_size"], dims["num_attention_heads"], \
        dims["num_key_value_heads"], dims["head_dim"]
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (dims["vocab_size"], h))]
    for i in range(dims["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.post_attention_layernorm.weight", (h,)),
                   (f"{p}.self_attn.q_proj.weight", (heads * hd, h)), (f"{p}.self_attn.k_proj.weight", (kv * hd, h)),
                   (f"{p}.self_attn.v_proj.weight", (kv * hd, h)), (f"{p}.self_attn.o_proj.weight", (h, heads * hd)),
                   (f"{p}.self_attn.q_norm.weight", (hd,)), (f"{p}.self_attn.k_norm.weight", (hd,)),
                   (f"{p}.mlp.gate_proj.weight", (inter, h)), (f"{p}.mlp.up_proj.weight", (inter, h)),
                   (f"{p}.mlp.down_proj.weight", (h, inter))]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (dims["vocab_size"], h))]
    writer = CheckpointWriter(directory, [TensorSpec(n, torch.bfloat16, s) for n, s in shapes])
    gen = torch.Generator().manual_seed(seed)
    for name, shape in shapes:
        t = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.02
        writer.write(name, t.to(torch.bfloat16))
    writer.close()
    config.save_pretrained(directory)
    return writer.total_bytes


def _largest_group_bytes(directory: Path) -> int:
    from adapters.hf_checkpoint.reader import HfCheckpoint
    from domain.quant import naming

    groups: dict[str, int] = {}
    biggest = 0
    for name, shape, dtype in HfCheckpoint(directory).tensor_specs():
        size = torch.Size(shape).numel() * dtype.itemsize
        group = naming.classify(name, shape).group
        biggest = max(biggest, size)
        if group:
            groups[group] = groups.get(group, 0) + size
    return max([biggest, *groups.values()])


# --- the two measured paths, each run in a child process ---------------------------------------




def _ours(src: str, out: str) -> None:
    from adapters.hf_checkpoint.reader import HfCheckpoint
    from app.config_sections import QuantizationConfig, RefitConfig, RolloutConfig
    from app.services.checkpoint_export import export_checkpoint
    from app.services.planning import make_plan

    checkpoint = HfCheckpoint(src)
    # weight-only NVFP4 in the compressed-tensors layout, what compressed-tensors' path writes too; the
    # default engine's plan (every engine that reads that layout gets the same files)
    quantization = QuantizationConfig(linear=PRESET, linear_activation="none")
    report = make_plan(RefitConfig(rollout=RolloutConfig(quantization=quantization)), checkpoint)
    export_checkpoint(checkpoint, out, report)


def _compressed_tensors(src: str, out: str) -> None:
    """compressed-tensors' own path, as llm-compressor drives it: load the model, attach the
    schemes, compute each module's scales (min/max observer, calculate_qparams), compress with
    ModelCompressor, save_pretrained, write the config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
    from transformers import AutoModelForCausalLM

    from adapters.compressed_tensors.quantization_config import attach_schemes, compressed_tensors_config
    from domain.quant.plan import QuantizationPlan

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    qc: QuantizationConfig = compressed_tensors_config(QuantizationPlan.from_presets(linear=PRESET))
    attach_schemes(model, qc)
    with torch.no_grad():
        for _, module in model.named_modules():
            scheme = getattr(module, "quantization_scheme", None)
            if scheme is None or not isinstance(module, torch.nn.Linear):
                continue
            w = module.weight.float()
            gs = generate_gparam(w.amin().reshape(1), w.amax().reshape(1))
            g = w.reshape(w.shape[0], -1, 16)
            scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights, global_scale=gs)
            getattr(module, "weight_global_scale").data.copy_(gs)  # noqa: B009 - registered by compressed-tensors
            getattr(module, "weight_scale").data.copy_(scale)  # noqa: B009
    compressor = ModelCompressor(quantization_config=qc)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)


def _child(which: str, src: str, out: str) -> None:
    import app.bench.export as me

    fn = me._ours if which == "ours" else me._compressed_tensors
    # import what the path needs before the peak is reset: imports are not export memory
    import compressed_tensors.compressors  # noqa: F401
    import transformers  # noqa: F401

    import app.services.checkpoint_export  # noqa: F401

    base = reset_peak_rss()
    t0 = time.perf_counter()
    run_reporting(lambda: fn(src, out))
    seconds = time.perf_counter() - t0
    peak = process_kib("VmHWM")
    sys.stdout.write(json.dumps({"seconds": seconds, "peak_kib": peak, "base_kib": base}) + "\n")


def _run_child(which: str, src: Path, out: Path) -> dict[str, Any]:
    code = f"import sys; from app.bench.export import _child; _child({which!r}, {str(src)!r}, {str(out)!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                          cwd=Path(__file__).resolve().parents[2])
    typed = typed_error(proc.stdout) if proc.returncode == 2 else None
    if typed is not None:  # e.g. NonFiniteTensor: what `refit export` says on the same directory
        raise typed
    if proc.returncode != 0:
        raise RuntimeError(f"bench child {which!r} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _largest_file(directory: Path) -> int:
    """The largest .safetensors file of a checkpoint directory, bytes (0: none)."""
    return max((f.stat().st_size for f in directory.glob("*.safetensors")), default=0)


def _checkpoint_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def run(quick: bool = False, model_dir: str | Path | None = None) -> BenchReport:
    """Run the suite.

    Args:
        quick: the small built checkpoint instead of the ~0.5 GB one.
        model_dir: a BF16 Hugging Face checkpoint directory to export instead of a built one
            (`refit bench export --model DIR`; e.g. python -m app.bench.fixtures qwen3-0.6b DIR).
    """
    report = BenchReport("export")
    dims = QUICK if quick else FULL
    with tempfile.TemporaryDirectory(prefix="refit-bench-export-") as tmp:
        if model_dir is None:
            src = Path(tmp) / "model"
            src.mkdir()
            total = build_checkpoint(src, dims)
            case = f"Qwen3 {total / 2**20:.0f} MiB bf16 -> linear {PRESET}"
        else:
            src = Path(model_dir).resolve()
            total = _checkpoint_bytes(src)
            case = f"{src.name} {total / 2**20:.0f} MiB bf16 -> linear {PRESET}"
        group = _largest_group_bytes(src)
        mb = total / 2**20
        ours = _run_child("ours", src, Path(tmp) / "ours")
        ct = _run_child("ct", src, Path(tmp) / "ct")
        shard, out_shard = _largest_file(src), _largest_file(Path(tmp) / "ours")
        ours_peak = (ours["peak_kib"] - ours["base_kib"]) / 1024
        ct_peak = (ct["peak_kib"] - ct["base_kib"]) / 1024
        report.add(case, "export throughput", mb / ours["seconds"], "MiB/s",
                   baseline="compressed-tensors ModelCompressor", baseline_value=mb / ct["seconds"])
        report.add(case, "peak RSS above imports", ours_peak, "MiB",
                   baseline="compressed-tensors ModelCompressor", baseline_value=ct_peak)
        report.add(case, "peak RSS / checkpoint size", ours_peak / mb, "ratio",
                   baseline="compressed-tensors ModelCompressor", baseline_value=ct_peak / mb)
        report.add(case, "largest fused group or tensor", group / 2**20, "MiB")
        bound = (1.1 * shard + out_shard) / 2**20
        report.add(case, "peak RSS above imports vs 1.1 x largest shard + its output", ours_peak, "MiB",
                   baseline="bound: 1.1 x largest source shard + largest output shard", baseline_value=bound,
                   figure="memory")
        overhead = ours_peak - group / 2**20
        report.notes.append(
            f"streaming export: peak {ours_peak:.1f} MiB = largest fused group or single tensor {group / 2**20:.1f} MiB"
            f" + {overhead:.1f} MiB overhead (codec temporaries on 2^20-element row chunks, allocator reuse), "
            f"for a {mb:.0f} MiB checkpoint"
        )
        report.notes.append(
            f"the bound row: largest source shard {shard / 2**20:.1f} MiB, largest output shard "
            f"{out_shard / 2**20:.1f} MiB; ratio = bound / peak (1 or more: within the bound). The peak RSS "
            "counts the memory-mapped pages of the source shards that were read")
        report.notes.append(
            "baseline: transformers from_pretrained, apply_quantization_config, per-module min/max scales with "
            "calculate_qparams, ModelCompressor.compress_model, save_pretrained, update_config"
        )
    return report
