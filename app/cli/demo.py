"""`refit demo`: the main job. Until the refit lifecycle lands it shows the format codecs.

Interim content, labelled as such in its output: the table of precision presets and a
quantize/dequantize round trip of a random tensor through each codec.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from rich.console import Console
from rich.table import Table

from domain.formats import FORMATS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the main job: a refit round trip on the embedded default model")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from domain.codecs import dequantize_weight, quantize_weight

    gen = torch.Generator().manual_seed(args.seed)
    w = torch.randn(256, 512, generator=gen).to(torch.bfloat16)
    rows = []
    for fmt in FORMATS.values():
        if not fmt.is_quantized:
            continue
        q = quantize_weight(fmt, w, name="demo.weight")
        back = dequantize_weight(q)
        err = (back - w.float()).abs()
        rows.append(
            {
                "format": fmt.name,
                "tensors": {k: [list(t.shape), str(t.dtype).removeprefix("torch.")] for k, t in q.tensors.items()},
                "bytes": sum(t.numel() * t.element_size() for t in q.tensors.values()),
                "max_abs_err": err.max().item(),
                "rel_rmse": (err.square().mean().sqrt() / w.float().square().mean().sqrt()).item(),
            }
        )
    if args.json:
        sys.stdout.write(json.dumps({"stage": "codec round trip (interim demo)", "formats": rows}, indent=2))
        sys.stdout.write("\n")
        return 0
    console = Console()
    console.print("[bold]refit demo[/bold] (interim: codec round trip of a random 256x512 bf16 tensor)")
    table = Table()
    for col in ("format", "checkpoint tensors", "bytes (bf16: 262144)", "max |err|", "relative RMSE"):
        table.add_column(col)
    for r in rows:
        tensors = ", ".join(f"{k} {v[1]}{v[0]}" for k, v in r["tensors"].items())
        table.add_row(r["format"], tensors, str(r["bytes"]), f"{r['max_abs_err']:.4f}", f"{r['rel_rmse']:.4f}")
    console.print(table)
    return 0
