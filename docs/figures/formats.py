"""Draws docs/figures/formats.png: the representable grids and the quantization error per format.

Run: .venv/bin/python docs/figures/formats.py
"""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from domain.quant.codecs import dequantize_weight, quantize_weight
from domain.quant.formats import E2M1_VALUES, FP8_BLOCK, MXFP4, MXFP8, NVFP4, MxScaleRule

OUT = pathlib.Path(__file__).with_suffix(".png")


def main() -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))

    e4m3 = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3 = e4m3[torch.isfinite(e4m3) & (e4m3 > 0)]
    ax = axes[0]
    ax.scatter(e4m3, torch.full_like(e4m3, 1.0), marker="|", s=300, label="E4M3 (max 448)")
    ax.scatter(torch.tensor(E2M1_VALUES[1:]), torch.zeros(7), marker="|", s=300, color="C3",
               label="E2M1 (max 6)")
    ax.set_xscale("log", base=2)
    ax.set_yticks([0, 1], ["E2M1", "E4M3"])
    ax.set_ylim(-0.7, 1.7)
    ax.set_title("Positive representable values (log2 axis)")
    ax.set_xlabel("value")

    g = torch.Generator().manual_seed(0)
    w = torch.randn(1024, 1024, generator=g).to(torch.bfloat16)
    cases = [("FP8_BLOCK", FP8_BLOCK, None), ("MXFP8 rceil", MXFP8, MxScaleRule.RCEIL),
             ("MXFP8 even", MXFP8, MxScaleRule.EVEN), ("MXFP4 rceil", MXFP4, MxScaleRule.RCEIL),
             ("MXFP4 even", MXFP4, MxScaleRule.EVEN), ("NVFP4", NVFP4, None)]
    names, errors, bits = [], [], []
    for label, fmt, rule in cases:
        q = quantize_weight(fmt, w, scale_rule=rule)
        err = dequantize_weight(q) - w.float()
        names.append(label)
        errors.append((err.square().mean().sqrt() / w.float().square().mean().sqrt()).item())
        bits.append(8 * q.nbytes / w.numel())
    ax = axes[1]
    bars = ax.bar(names, errors, color=["C0", "C1", "C1", "C2", "C2", "C3"])
    ax.bar_label(bars, labels=[f"{e:.3f}\n{b:.2f} bits/w" for e, b in zip(errors, bits, strict=True)], fontsize=8)
    ax.set_ylim(0, max(errors) * 1.25)
    ax.set_ylabel("relative RMS error")
    ax.set_title("Quantization error, Gaussian 1024x1024 bf16")
    ax.tick_params(axis="x", rotation=30)

    fig.tight_layout()
    fig.savefig(OUT, dpi=110)
    for n, b, e in zip(names, bits, errors, strict=True):
        print(f"| {n} | {b:.2f} | {e:.4f} |")


if __name__ == "__main__":
    main()
