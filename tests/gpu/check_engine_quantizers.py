#!/usr/bin/env python3
"""GPU check: the exporter's `engine` rule against vLLM's own CUDA quantizers, bit for bit (< 8 min on one H200).

    python3 tests/gpu/check_engine_quantizers.py [--python PY | --venv DIR [--wheelhouse DIR] [--skip-install]] [--out DIR]

What it does:
1. environment: `--python PY` uses an interpreter that already has the pinned vllm; otherwise a
   virtual environment of its own (`--venv`, default .cache/vllm-gpu-venv) with the pinned vllm
   (plus attrs and structlog); `--wheelhouse DIR` installs offline from wheels in DIR.
2. compares, on CUDA, on the test matrix of tests/codecs/matrix.py (real-shaped weights, normals
   at several scales, special values, zero and tiny-amax blocks, exact ties, edge blocks,
   experts) and on activations with per-token scales from 1e-3 to 1e3 and tiny groups:
   - FP8_BLOCK weights: `per_block_cast_to_fp8` on the GPU;
   - FP8 1x128 activations: the `per_token_group_quant_fp8` CUDA kernel (float scales);
   - NVFP4 weights and per-token activations: the `scaled_fp4_quant` CUDA kernel (needs SM100:
     named as not run elsewhere);
   - MXFP4: `mxfp4_quantize` (the Triton kernel `downcast_to_mxfp`);
   - MXFP8: `mxfp8_e4m3_quantize` (FlashInfer's kernel on SM100, the torch path elsewhere);
   - the codecs themselves on CUDA against the same codecs on CPU, under both element rules.
   Each comparison counts the elements and scales that differ; one that cannot run on this GPU
   (or with this vLLM build) is recorded with the reason, not failed.
3. writes summary.json to --out, prints a table; exit 0 when every comparison that ran matched.

This top level uses the standard library only (it runs under any python3); the comparisons run in
the chosen environment with the repository on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]


def pinned_vllm() -> str:
    text = (ROOT / "adapters" / "vllm" / "profile.py").read_text()
    return re.search(r'PINNED_VLLM = "([^"]+)"', text).group(1)  # type: ignore[union-attr]


# --- verdict (pure, tested on CPU) -----------------------------------------------------------------


def verdict(results: list[dict]) -> tuple[bool, list[str]]:
    """Pass when every comparison that ran matched; name the ones that could not run.

    Args:
        results: one dict per comparison: {"name", "ran", "reason" (when not), "differ",
            "elements", "error" (when it raised)}.

    Returns:
        (ok, lines to print).
    """
    lines, ok = [], bool(results)
    for r in results:
        if "error" in r:
            ok = False
            lines.append(f"FAILED  {r['name']}: raised {r['error']}")
        elif not r["ran"]:
            lines.append(f"not run {r['name']}: {r['reason']}")
        elif r["differ"]:
            ok = False
            lines.append(f"FAILED  {r['name']}: {r['differ']} of {r['elements']} differ")
        else:
            lines.append(f"ok      {r['name']}: all {r['elements']} equal")
    return ok, lines


# --- the comparisons (run in the vLLM environment, on CUDA) ------------------------------------------


def _comparisons() -> list[dict]:  # pragma: no cover - needs CUDA and vLLM
    import torch

    from domain.quant.codecs import fake_quantize_activation, quantize_weight
    from domain.quant.codecs.elements import e2m1_values, unpack_fp4
    from domain.quant.formats import FP8_BLOCK, MXFP4, MXFP8, NVFP4, ActivationScheme, ElementRule
    from tests.codecs.matrix import cases

    engine = ElementRule.ENGINE
    dev = torch.device("cuda")
    major, minor = torch.cuda.get_device_capability()

    def bits(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]).cpu()

    def count(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int]:
        differ = sum(int((bits(a) != bits(b)).sum()) for a, b in pairs)
        return differ, sum(a.numel() for a, _ in pairs)

    def weights(fmt) -> list[tuple[str, torch.Tensor]]:
        out = []
        for name, w in cases(fmt).items():
            out += [(f"{name}[{e}]", one) for e, one in enumerate(w)] if w.dim() == 3 else [(name, w)]
        return out

    def activations() -> torch.Tensor:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 1024, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(-1)
        x[:4] *= torch.tensor([0.0, 1e-12, 1e-9, 1e-6]).unsqueeze(-1)
        return x.to(torch.bfloat16)

    results: list[dict] = []

    def run(name: str, fn, skip: str | None = None) -> None:
        if skip:
            results.append({"name": name, "ran": False, "reason": skip})
            return
        t0 = time.time()
        try:
            differ, elements = fn()
            results.append({"name": name, "ran": True, "differ": differ, "elements": elements,
                            "seconds": round(time.time() - t0, 1)})
        except Exception as err:  # reported, then judged by verdict()
            results.append({"name": name, "ran": True, "error": f"{type(err).__name__}: {err}"[:500]})

    def fp8_block() -> tuple[int, int]:
        from vllm.utils.deep_gemm import per_block_cast_to_fp8

        pairs = []
        for _, w in weights(FP8_BLOCK):
            q, s = per_block_cast_to_fp8(w.to(dev))
            ours = quantize_weight(FP8_BLOCK, w, numerics=engine).tensors
            pairs += [(ours["weight"], q), (ours["weight_scale"], s)]
        return count(pairs)

    def fp8_group() -> tuple[int, int]:
        from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

        x = activations()
        q, s = per_token_group_quant_fp8(x.to(dev), 128, use_ue8m0=False)
        want = (q.float().reshape(64, -1, 128) * s.unsqueeze(-1)).reshape(x.shape).to(x.dtype)
        return count([(fake_quantize_activation(ActivationScheme.FP8_GROUP_128, x, numerics=engine), want)])

    def nvfp4_weights() -> tuple[int, int]:
        from vllm._custom_ops import scaled_fp4_quant

        pairs = []
        for _, w in weights(NVFP4):
            if w.dtype not in (torch.bfloat16, torch.float16):
                continue  # the kernel takes 16-bit inputs only
            ours = quantize_weight(NVFP4, w, numerics=engine).tensors
            packed, scale = scaled_fp4_quant(w.to(dev), ours["weight_global_scale"].to(dev), is_sf_swizzled_layout=False)
            pairs += [(ours["weight_packed"], packed.view(torch.uint8)),
                      (ours["weight_scale"], scale.reshape(ours["weight_scale"].shape))]
        return count(pairs)

    def nvfp4_tokens() -> tuple[int, int]:
        from vllm._custom_ops import scaled_fp4_quant

        x = activations()
        ours = fake_quantize_activation(ActivationScheme.NVFP4_PER_TOKEN, x, numerics=engine)
        rows = []
        for t in range(x.shape[0]):
            row = x[t:t + 1]
            gs = quantize_weight(NVFP4, row, numerics=engine).tensors["weight_global_scale"]
            packed, scale = scaled_fp4_quant(row.to(dev), gs.to(dev), is_sf_swizzled_layout=False)
            values = e2m1_values(unpack_fp4(packed.view(torch.uint8).cpu())).reshape(1, -1, 16)
            rows.append((values * (scale.float().cpu().reshape(1, -1, 1) / gs)).reshape(row.shape).to(x.dtype))
        return count([(ours, torch.cat(rows))])

    def mxfp4() -> tuple[int, int]:
        from vllm.model_executor.layers.quantization.utils.mxfp4_utils import mxfp4_quantize

        pairs = []
        for _, w in weights(MXFP4):
            if w.dtype not in (torch.bfloat16, torch.float16):
                continue  # the Triton kernel takes 16-bit inputs only
            packed, scale = mxfp4_quantize(w.to(dev))
            ours = quantize_weight(MXFP4, w, numerics=engine).tensors
            pairs += [(ours["weight_packed"], packed), (ours["weight_scale"], scale)]
        return count(pairs)

    def mxfp8() -> tuple[int, int]:
        from vllm.model_executor.layers.quantization.utils.mxfp8_utils import mxfp8_e4m3_quantize

        pairs = []
        for _, w in weights(MXFP8):
            q, scale = mxfp8_e4m3_quantize(w.to(dev))
            ours = quantize_weight(MXFP8, w, numerics=engine).tensors
            pairs += [(ours["weight"], q), (ours["weight_scale"], scale.reshape(ours["weight_scale"].shape))]
        return count(pairs)

    def codecs_on_cuda() -> tuple[int, int]:
        pairs = []
        for rule in ElementRule:
            for fmt in (FP8_BLOCK, MXFP8, MXFP4, NVFP4):
                for _, w in weights(fmt):
                    cpu = quantize_weight(fmt, w, numerics=rule).tensors
                    gpu = quantize_weight(fmt, w.to(dev), numerics=rule).tensors
                    pairs += [(cpu[k], gpu[k]) for k in cpu]
            x = activations()
            for scheme in (ActivationScheme.FP8_GROUP_128, ActivationScheme.MXFP8, ActivationScheme.MXFP4,
                           ActivationScheme.NVFP4_PER_TOKEN):
                pairs.append((fake_quantize_activation(scheme, x, numerics=rule),
                              fake_quantize_activation(scheme, x.to(dev), numerics=rule)))
        return count(pairs)

    sm100 = None if major >= 10 else f"scaled_fp4_quant needs SM100 (Blackwell); this GPU is SM{major}{minor}"
    run("FP8_BLOCK weights vs per_block_cast_to_fp8 (CUDA)", fp8_block)
    run("FP8 1x128 activations vs per_token_group_quant_fp8 (CUDA kernel)", fp8_group)
    run("NVFP4 weights vs scaled_fp4_quant (CUDA kernel)", nvfp4_weights, sm100)
    run("NVFP4 per-token activations vs scaled_fp4_quant per token (CUDA kernel)", nvfp4_tokens, sm100)
    run("MXFP4 weights vs mxfp4_quantize (Triton downcast_to_mxfp)", mxfp4)
    run("MXFP8 weights vs mxfp8_e4m3_quantize (CUDA)", mxfp8)
    run("codecs on CUDA vs the codecs on CPU, both element rules", codecs_on_cuda)
    return results


def child(out: pathlib.Path) -> int:  # pragma: no cover - needs CUDA and vLLM
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    results = _comparisons()
    ok, lines = verdict(results)
    summary = {"ok": ok, "gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
               "results": results, "lines": lines}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("\n".join(lines))
    return 0 if ok else 1


def install(venv: pathlib.Path, wheelhouse: str | None) -> pathlib.Path:
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    cmd = [str(py), "-m", "pip", "install", "-q", f"vllm=={pinned_vllm()}", "attrs", "structlog"]
    if wheelhouse:
        cmd += ["--no-index", "--find-links", wheelhouse]
    subprocess.run(cmd, check=True)
    return py


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=None, help="an interpreter that already has the pinned vllm")
    ap.add_argument("--venv", default=str(ROOT / ".cache" / "vllm-gpu-venv"))
    ap.add_argument("--wheelhouse", default=None, help="install offline from the wheels in this directory")
    ap.add_argument("--skip-install", action="store_true", help="reuse the environment in --venv")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "out" / "gpu-engine-quantizers"))
    ap.add_argument("--timeout", type=float, default=420, help="seconds for the comparisons")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.child:
        return child(out)
    t0 = time.time()
    if args.python:
        py = pathlib.Path(args.python)
    else:
        venv = pathlib.Path(args.venv)
        py = venv / "bin" / "python" if args.skip_install else install(venv, args.wheelhouse)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        code = subprocess.run([str(py), str(pathlib.Path(__file__).resolve()), "--out", str(out), "--child"],
                              env=env, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        print(f"FAILED: the comparisons did not finish in {args.timeout:.0f} s")
        return 1
    print(f"{'PASSED' if code == 0 else 'FAILED'} in {time.time() - t0:.0f} s; details in {out / 'summary.json'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
