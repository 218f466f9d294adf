#!/usr/bin/env python3
"""GPU check of the vLLM adapter: FP8_BLOCK refits through vLLM's layerwise reload (H200, < 8 min).

    python3 tests/gpu/check_vllm_refit.py [--venv DIR] [--wheelhouse DIR] [--skip-install] [--out DIR]

What it does:
1. install: a virtual environment of its own (`--venv`, default .cache/vllm-gpu-venv) with the
   pinned vllm (plus attrs and structlog for the adapter); `--wheelhouse DIR` installs offline
   from wheels in DIR; `--skip-install` reuses an existing environment.
2. model: a tiny random Llama (2 layers, hidden 256), generated locally and saved as a Hugging
   Face checkpoint: nothing is downloaded.
3. three engines, in parallel, each in its own process:
   - bf16: the checkpoint as is (the reference);
   - fp8: started with a dummy load and the FP8_BLOCK quantization_config, then refitted twice
     through VllmRolloutEngine (trainer-side quantization, 16 MiB buckets in one reused buffer);
   - fp8-kv: the same with `kv_cache_dtype=fp8` (KV-cache scales must be reset to 1.0).
   Each refit checks the captured storage (pointer, shape, stride, dtype of every parameter and
   buffer) before and after, and that the engine refuses to serve before its first refit.
4. compare: greedy continuations and prompt log-probs of the FP8 engines against BF16, within
   the FP8 bound (see BOUNDS). Prints a table, writes summary.json, exits 0 when all pass.

This top level uses the standard library only (it runs under any python3); the stages run in the
created environment with the repository on PYTHONPATH.
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
QCONFIG = pathlib.Path(__file__).with_name("fp8_block_quantization_config.json")
PROMPTS = [[(7 * i + 13 * j) % 1000 + 3 for j in range(12)] for i in range(8)]
NEW_TOKENS = 16
# The FP8 bound: E4M3 keeps 3 mantissa bits (relative rounding error <= 2^-4 per element) and
# activations are quantized per 1x128 group too; on this model that moves log-probs by a few
# hundredths of a nat on average. A refit that failed to load (dummy weights) or a wrong layout
# is off by whole nats.
BOUNDS = {"fp8": {"mean_abs_logp": 0.10, "max_abs_logp": 1.0, "greedy_agreement": 0.80},
          "fp8-kv": {"mean_abs_logp": 0.15, "max_abs_logp": 1.5, "greedy_agreement": 0.70}}


def pinned_vllm() -> str:
    text = (ROOT / "adapters" / "vllm" / "profile.py").read_text()
    return re.search(r'PINNED_VLLM = "([^"]+)"', text).group(1)  # type: ignore[union-attr]


# --- comparison (pure, tested on CPU) --------------------------------------------------------------


def compare(reference: dict, candidate: dict, bounds: dict) -> dict:
    """Log-prob and greedy-decoding agreement of `candidate` with `reference`, against `bounds`."""
    diffs = [abs(a - b) for ra, rb in zip(reference["logprobs"], candidate["logprobs"], strict=True)
             for a, b in zip(ra, rb, strict=True)]
    tokens = [(a == b) for ra, rb in zip(reference["greedy"], candidate["greedy"], strict=True)
              for a, b in zip(ra, rb, strict=True)]
    out = {"mean_abs_logp": sum(diffs) / len(diffs), "max_abs_logp": max(diffs),
           "greedy_agreement": sum(tokens) / len(tokens)}
    out["ok"] = (out["mean_abs_logp"] <= bounds["mean_abs_logp"] and out["max_abs_logp"] <= bounds["max_abs_logp"]
                 and out["greedy_agreement"] >= bounds["greedy_agreement"])
    return out


def verdict(results: dict[str, dict]) -> tuple[bool, list[str]]:
    """Every check of the engine runs and comparisons; (all passed, lines to print)."""
    lines, ok = [], True
    for arm in ("fp8", "fp8-kv"):
        run = results.get(arm)
        if run is None or "error" in run:
            lines.append(f"{arm}: FAILED to run: {None if run is None else run['error']}")
            ok = False
            continue
        checks = {"stale before the first refit": run["stale_before_refit"],
                  "storage kept over both refits": all(r["storage_changed"] == [] for r in run["refits"]),
                  "KV scales reset (fp8 KV cache)": arm != "fp8-kv" or all(v == 1.0 for v in run["k_scales"])}
        cmp = compare(results["bf16"], run, BOUNDS[arm])
        for name, passed in checks.items():
            lines.append(f"{arm}: {name}: {'ok' if passed else 'FAILED'}")
            ok &= bool(passed)
        lines.append(f"{arm}: mean |dlogp| {cmp['mean_abs_logp']:.4f}, max {cmp['max_abs_logp']:.4f}, greedy "
                     f"agreement {cmp['greedy_agreement']:.3f}: {'ok' if cmp['ok'] else 'FAILED'} (bounds {BOUNDS[arm]})")
        ok &= cmp["ok"]
    return ok, lines


# --- stages run inside the engine's environment ---------------------------------------------------


def stage_model(out: pathlib.Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
        model.lm_head.weight.mul_(8.0)  # peaked distributions: greedy decoding is well defined
    model.save_pretrained(out / "model", safe_serialization=True)


def _llm_kwargs(out: pathlib.Path) -> dict:
    return {"model": str(out / "model"), "skip_tokenizer_init": True, "dtype": "bfloat16", "seed": 0,
            "max_model_len": 256, "kv_cache_memory_bytes": 2 << 30, "gpu_memory_utilization": 0.25,
            "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8]}}


def _serve(llm) -> dict:  # type: ignore[no-untyped-def]
    import torch

    from adapters.vllm.client import LlmLogProbs, greedy_tokens

    ids = torch.tensor(PROMPTS)
    logp, _ = LlmLogProbs(llm)(ids, 1.0)
    return {"logprobs": logp.tolist(), "greedy": greedy_tokens(llm, PROMPTS, NEW_TOKENS)}


def stage_bf16(out: pathlib.Path) -> dict:
    from vllm import LLM

    return _serve(LLM(**_llm_kwargs(out)))


def stage_fp8(out: pathlib.Path, kv_cache_dtype: str) -> dict:
    import torch

    from adapters.profiles import backend_decision as decide_backends
    from adapters.vllm.factory import vllm_engine_kwargs, vllm_environment
    from domain.quant.plan import QuantizationPlan

    plan = QuantizationPlan.from_presets(linear="FP8_BLOCK")
    decision = decide_backends("vllm", plan, torch.cuda.get_device_capability())
    os.environ.update(vllm_environment(decision, colocated=True))  # the worker in this process: views reach it
    qc = json.loads(QCONFIG.read_text())
    base = {**_llm_kwargs(out), "load_format": "dummy"}
    kwargs = vllm_engine_kwargs(qc, decision, kv_cache_dtype=kv_cache_dtype, base=base)

    from safetensors.torch import load_file

    from adapters.vllm.client import ExtensionWorkers, LlmLogProbs
    from adapters.vllm.engine import VllmRolloutEngine
    from domain.errors import EngineStale
    from domain.quant.naming import natural_key
    from domain.quant.stream import quantize_stream
    from domain.refit.buckets import pack_buckets

    workers = ExtensionWorkers.launch(**kwargs)
    llm = workers.llm
    engine = VllmRolloutEngine(workers, LlmLogProbs(llm))
    try:
        engine.log_probs(torch.tensor(PROMPTS))
        stale_before = False
    except EngineStale:
        stale_before = True
    weights = {}
    for f in sorted((out / "model").glob("*.safetensors")):
        weights.update(load_file(str(f)))
    named = sorted(weights.items(), key=lambda kv: natural_key(kv[0]))
    refits = []
    for refit_id in (1, 2):
        before = engine.storage_fingerprint()
        t0 = time.perf_counter()
        engine.begin_refit(refit_id)
        for bucket in pack_buckets(quantize_stream(plan, named), 16 << 20, reuse_buffer=True):
            engine.load_bucket(bucket)
        result = engine.finalize_refit()
        refits.append({"seconds": time.perf_counter() - t0, "kv_scales_reset": result.kv_scales_reset,
                       "tensors": result.tensors_committed,
                       "storage_changed": before.differences(engine.storage_fingerprint())})
    live = engine.live_weights()
    k_scales = [float(t) for n, t in live.items() if n.endswith("attn._k_scale")]
    return {**_serve(llm), "stale_before_refit": stale_before, "refits": refits, "k_scales": k_scales,
            "backends": decision.reasons()}


def child(stage: str, out: pathlib.Path) -> int:
    try:
        if stage == "model":
            stage_model(out)
            return 0
        result = stage_bf16(out) if stage == "bf16" else stage_fp8(out, "fp8" if stage == "fp8-kv" else "auto")
    except Exception as err:  # reported by the orchestrator, which fails the check
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(err).__name__}: {err}"}
    (out / f"{stage}.json").write_text(json.dumps(result))
    return 0 if "error" not in result else 1


# --- orchestration (standard library only) ---------------------------------------------------------


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
    ap.add_argument("--venv", default=str(ROOT / ".cache" / "vllm-gpu-venv"))
    ap.add_argument("--wheelhouse", default=None, help="install offline from the wheels in this directory")
    ap.add_argument("--skip-install", action="store_true", help="reuse the environment in --venv")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "out" / "gpu-check"))
    ap.add_argument("--timeout", type=float, default=420, help="seconds for the engine stages")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.child:
        return child(args.child, out)
    t0 = time.time()
    venv = pathlib.Path(args.venv)
    py = venv / "bin" / "python" if args.skip_install else install(venv, args.wheelhouse)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    me = [str(py), str(pathlib.Path(__file__).resolve()), "--out", str(out), "--child"]
    subprocess.run([*me, "model"], check=True, env=env, timeout=120)
    procs = {s: subprocess.Popen([*me, s], env=env) for s in ("bf16", "fp8", "fp8-kv")}
    deadline = time.time() + args.timeout
    for stage, proc in procs.items():
        try:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            (out / f"{stage}.json").write_text(json.dumps({"error": f"timed out after {args.timeout} s"}))
    results = {s: json.loads((out / f"{s}.json").read_text()) if (out / f"{s}.json").exists()
               else {"error": "no result"} for s in procs}
    if "error" in results["bf16"]:
        print(f"bf16 reference FAILED: {results['bf16']['error']}")
        return 1
    ok, lines = verdict(results)
    summary = {"ok": ok, "lines": lines, "seconds": time.time() - t0,
               "refits": {a: results[a].get("refits") for a in ("fp8", "fp8-kv")}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("\n".join(lines))
    print(f"{'PASSED' if ok else 'FAILED'} in {summary['seconds']:.0f} s; details in {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
