#!/usr/bin/env python3
"""GPU check of the support matrix's NVFP4 and MX cells on vLLM (one H200; written to finish in < 8 min).

    python3 tests/gpu/check_support_matrix.py [--python PY | --venv DIR [--wheelhouse DIR] [--skip-install]] [--out DIR]

For every NVFP4 and MX cell that `refit plan` accepts for vLLM (domain.quant.support marks them
GPU_SCRIPT; test_support_matrix_gpu.py checks that ARMS covers exactly those), on a tiny random
Qwen3-MoE generated locally (nothing is downloaded):
1. cold: the trainer's export written as a checkpoint (tensors and the quantization_config
   `refit plan` gives), loaded by vLLM as it is;
2. refit: vLLM started from a dummy load with the same quantization_config, refitted twice through
   VllmRolloutEngine. Before the first refit, the checkpoint-format parameters vLLM's schemes
   allocated (vLLM's layerwise reload restores them) are compared with the export: every
   allocated tensor exported (or named in ALLOWED_UNEXPORTED, with the engine's reason), none
   exported that is not allocated, shapes and dtypes equal;
3. the refitted engine's prompt log-probs and greedy tokens equal the cold start's (a wrong load
   is off by whole nats), the engine refused to serve before its first refit, storage is kept.
The kernels vLLM chose are recorded. On a GPU below SM100 (an H200 is SM90) vLLM has no kernels for
the declared MXFP8 / MXFP4 activations and serves those layers weight-only (Marlin): the arms
still load, refit and compare, and the summary names the Blackwell kernels that did not run and
why. The capability gates of the backend policy refuse MX and NVFP4 below SM100, so there the
decision is made without a capability (nothing requested, vLLM chooses).

Writes summary.json (and each arm's results) to --out, prints one line per check, exits 1 on a
failure. The top level uses the standard library only; the stages run in the vLLM environment
with the repository on PYTHONPATH.
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
# The plans, one engine pair (cold, refit) each: rollout.quantization keys.
ARMS: dict[str, dict[str, str | None]] = {
    "mxfp8": {"linear": "MXFP8", "moe": "MXFP8", "linear_activation": None, "moe_activation": None},
    "mxfp4": {"linear": "MXFP4", "moe": "MXFP4", "linear_activation": None, "moe_activation": None},
    "mxfp4-w4a8": {"linear": None, "moe": "MXFP4", "linear_activation": None, "moe_activation": "mxfp8"},
    "nvfp4-a16": {"linear": "NVFP4", "moe": "NVFP4", "linear_activation": "none", "moe_activation": "none"},
}
# Kernels the declared activations need, by arm (vLLM 0.33.0): what a GPU below SM100 does not run.
BLACKWELL_KERNELS = {
    "mxfp8": "FlashInfer MXFP8 Linear and TRT-LLM / DeepGEMM MXFP8 experts (SM100)",
    "mxfp4": "FlashInfer MXFP4 Linear and CUTLASS MXFP4 x MXFP4 experts (SM100)",
    "mxfp4-w4a8": "TRT-LLM MXFP4 x MXFP8 experts (SM100)",
    "nvfp4-a16": "FlashInfer CuTe-DSL W4A16 (SM100/SM103); Marlin is the weight-only kernel elsewhere",
}
# Checkpoint-format tensors a shown cell's scheme allocates that the export does not send, with the
# engine's reason (domain.quant.support_vllm cites it).
ALLOWED_UNEXPORTED = {
    "w13_input_global_scale": "NVFP4 weight-only experts: allocated by CompressedTensorsW4A4Nvfp4MoEMethod, "
                              "unused by the weight-only kernels",
    "w2_input_global_scale": "NVFP4 weight-only experts: allocated by CompressedTensorsW4A4Nvfp4MoEMethod, "
                             "unused by the weight-only kernels",
}
MODEL = {"vocab_size": 2048, "hidden_size": 1024, "intermediate_size": 1024, "moe_intermediate_size": 512,
         "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
         "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 512, "tie_word_embeddings": False,
         "decoder_sparse_step": 1, "norm_topk_prob": True, "mlp_only_layers": []}
PROMPTS = [[(7 * i + 13 * j) % 2000 + 3 for j in range(12)] for i in range(8)]
NEW_TOKENS = 12
# The refitted engine runs the cold start's kernels on the same weights: equal up to the order of
# floating-point reductions (atomics in some MoE kernels). A wrong or partial load is off by nats.
BOUNDS = {"max_abs_logp": 0.05, "greedy_agreement": 0.95}
# vLLM 0.33 keeps the experts' parameters in a RoutedExperts child of the layer's MoE runner.
ALIASES = ((".experts.routed_experts.", ".experts."),)
STACKED = {"q_proj": ("qkv_proj", 0, 3), "k_proj": ("qkv_proj", 1, 3), "v_proj": ("qkv_proj", 2, 3),
           "gate_proj": ("gate_up_proj", 0, 2), "up_proj": ("gate_up_proj", 1, 2)}
_EXPERT = re.compile(r"^(?P<layer>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.(?P<local>\w+)$")


def pinned_vllm() -> str:
    text = (ROOT / "adapters" / "vllm" / "profile.py").read_text()
    return re.search(r'PINNED_VLLM = "([^"]+)"', text).group(1)  # type: ignore[union-attr]


# --- layouts (pure, tested on CPU) -------------------------------------------------------------------


def engine_layout(exported: dict[str, tuple[list[int], str]]) -> dict[str, tuple[list[int], str]]:
    """What vLLM's Qwen3-MoE / Llama-family modules allocate for an export, in checkpoint format.

    Args:
        exported: checkpoint name -> (shape, dtype) of every tensor the export sends.

    Returns:
        engine parameter name -> (shape, dtype): q/k/v stacked into `qkv_proj` and gate/up into
        `gate_up_proj` along dim 0 (one entry per shard for 1-element global scales); per-expert
        `experts.N.{gate,up}_proj.X` into `experts.w13_X` [E, 2 * N, ...] and `down_proj.X` into
        `experts.w2_X` [E, ...] ([E, 2] and [E] for global scales); other names as they are.
        Raises ValueError when the pieces of one parameter disagree in dtype or trailing shape.
    """
    pieces: dict[str, dict[tuple[int, int], tuple[list[int], str]]] = {}
    out: dict[str, tuple[list[int], str]] = {}
    for name, (shape, dtype) in exported.items():
        m = _EXPERT.match(name)
        if m:
            w = "w2" if m["proj"] == "down_proj" else "w13"
            shard = STACKED[m["proj"]][1] if w == "w13" else 0
            pieces.setdefault(f"{m['layer']}.{w}_{m['local']}", {})[(int(m["e"]), shard)] = (list(shape), dtype)
            continue
        module, _, local = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if proj in STACKED:
            fused, shard, _n = STACKED[proj]
            pieces.setdefault(f"{parent}.{fused}.{local}", {})[(0, shard)] = (list(shape), dtype)
            continue
        out[name] = (list(shape), dtype)
    for name, parts in pieces.items():
        dtypes = {d for _, d in parts.values()}
        trailing = {tuple(s[1:]) for s, _ in parts.values()}
        if len(dtypes) != 1 or len(trailing) != 1:
            raise ValueError(f"{name}: pieces disagree: {sorted(parts.items())}")
        experts = sorted({e for e, _ in parts})
        shards = sorted({s for _, s in parts})
        first = next(iter(parts.values()))[0]
        scalar = first == [1]
        if ".experts." in name:
            rows = [len(experts), len(shards)] if scalar and len(shards) > 1 else [len(experts)]
            shape = rows if scalar else [len(experts), sum(parts[(experts[0], s)][0][0] for s in shards), *first[1:]]
        else:
            shape = [len(shards)] if scalar else [sum(parts[(0, s)][0][0] for s in shards), *first[1:]]
        out[name] = (shape, dtypes.pop())
    return out


def compare_layouts(expected: dict[str, tuple[list[int], str]], allocated: dict[str, tuple[list[int], str]],
                    modules: tuple[str, ...] = ("self_attn.", "mlp.")) -> dict[str, list[str]]:
    """Differences between what the export fills and what the engine allocated.

    Args:
        expected: engine_layout of the export.
        allocated: engine parameter name -> (shape, dtype), checkpoint format.
        modules: only parameters whose names contain one of these (the quantizable Linear layers).

    Returns:
        {"unexported": allocated but never sent (less ALLOWED_UNEXPORTED), "unallocated": sent but
        not allocated, "shape": ..., "dtype": ...}, each a sorted list of "name: detail".
    """
    allocated = {_alias(n): v for n, v in allocated.items()}
    keep = [n for n in {*expected, *allocated} if any(m in n for m in modules)]
    out: dict[str, list[str]] = {"unexported": [], "unallocated": [], "shape": [], "dtype": []}
    for n in sorted(keep):
        if n not in expected:
            local = n.rpartition(".")[2]
            if local not in ALLOWED_UNEXPORTED:
                out["unexported"].append(f"{n}: {allocated[n][1]} {allocated[n][0]}")
        elif n not in allocated:
            out["unallocated"].append(n)
        else:
            (es, ed), (as_, ad) = expected[n], allocated[n]
            if list(es) != list(as_):
                out["shape"].append(f"{n}: exported {es}, allocated {as_}")
            if ed != ad:
                out["dtype"].append(f"{n}: exported {ed}, allocated {ad}")
    return out


def _alias(name: str) -> str:
    for old, new in ALIASES:
        name = name.replace(old, new)
    return name


def compare_serving(cold: dict, refit: dict) -> dict:
    """Prompt log-prob and greedy agreement of the refitted engine with the cold start."""
    diffs = [abs(a - b) for ra, rb in zip(cold["logprobs"], refit["logprobs"], strict=True)
             for a, b in zip(ra, rb, strict=True)]
    tokens = [a == b for ra, rb in zip(cold["greedy"], refit["greedy"], strict=True) for a, b in zip(ra, rb, strict=True)]
    out = {"max_abs_logp": max(diffs), "greedy_agreement": sum(tokens) / len(tokens),
           "bit_identical": max(diffs) == 0.0 and all(tokens)}
    out["ok"] = out["max_abs_logp"] <= BOUNDS["max_abs_logp"] and out["greedy_agreement"] >= BOUNDS["greedy_agreement"]
    return out


def verdict(results: dict[str, dict], capability: list[int]) -> tuple[bool, list[str]]:
    """(all passed, lines): per arm, the layout, the stale and storage checks, cold == refit, skips."""
    lines, ok = [], bool(results)
    for arm in ARMS:
        cold, refit = results.get(f"{arm}-cold"), results.get(f"{arm}-refit")
        if cold is None or refit is None or "error" in cold or "error" in refit:
            ok = False
            lines += [f"{arm}: FAILED to run ({s}): {None if r is None else r['error']}"
                      for s, r in (("cold", cold), ("refit", refit)) if r is None or "error" in r]
            continue
        layout = refit["layout"]
        bad = {k: v for k, v in layout.items() if v}
        checks = {"layout equals what the schemes allocate": not bad,
                  "stale before the first refit": refit["stale_before_refit"],
                  "storage kept over both refits": all(r["storage_changed"] == [] for r in refit["refits"])}
        for name, passed in checks.items():
            detail = f" {json.dumps(bad)[:800]}" if name.startswith("layout") and not passed else ""
            lines.append(f"{arm}: {name}: {'ok' if passed else 'FAILED'}{detail}")
            ok &= bool(passed)
        cmp = compare_serving(cold, refit)
        lines.append(f"{arm}: refit vs cold start: max |dlogp| {cmp['max_abs_logp']:.2e}, greedy agreement "
                     f"{cmp['greedy_agreement']:.3f}{', bit-identical' if cmp['bit_identical'] else ''}: "
                     f"{'ok' if cmp['ok'] else 'FAILED'} (bounds {BOUNDS})")
        ok &= cmp["ok"]
        if capability[0] < 10:
            lines.append(f"{arm}: not run: {BLACKWELL_KERNELS[arm]}: this GPU is SM{capability[0]}{capability[1]}; "
                         f"vLLM chose {refit['kernels']}")
    return ok, lines


# --- stages run inside the vLLM environment ---------------------------------------------------------


def stage_model(out: pathlib.Path) -> None:  # pragma: no cover - needs transformers
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MODEL)).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.03)
        model.lm_head.weight.mul_(8.0)  # peaked distributions: greedy decoding is well defined
    model.save_pretrained(out / "model", safe_serialization=True)


def _plan_for(arm: str):  # type: ignore[no-untyped-def]  # pragma: no cover - stage helper
    from domain.quant.plan import QuantizationPlan

    return QuantizationPlan.from_presets(**ARMS[arm])


def _export(out: pathlib.Path, arm: str) -> tuple[list, dict, object]:  # pragma: no cover - needs the stack
    from safetensors.torch import load_file

    from adapters.engine_quantization import engine_quantization_config
    from adapters.profiles import resolve
    from app.services.planning import bf16_linear_modules
    from domain.quant.dispatch import DispatchInput
    from domain.quant.naming import natural_key
    from domain.quant.stream import quantize_stream

    weights: dict = {}
    for f in sorted((out / "model").glob("*.safetensors")):
        weights.update(load_file(str(f)))
    named = sorted(weights.items(), key=lambda kv: natural_key(kv[0]))
    shapes = [(n, tuple(t.shape)) for n, t in named]
    res = resolve(DispatchInput(engine="vllm", requested=_plan_for(arm)), shapes)  # raises for a rejected cell
    qc = engine_quantization_config(res, bf16_linear_modules(res.plan, shapes))
    exported = list(quantize_stream(res.plan, named))
    return exported, qc, res.plan


def _llm_kwargs(model: pathlib.Path) -> dict:
    return {"model": str(model), "skip_tokenizer_init": True, "dtype": "bfloat16", "seed": 0, "max_model_len": 256,
            "kv_cache_memory_bytes": 1 << 30, "gpu_memory_utilization": 0.15, "enforce_eager": True}


def _serve(llm) -> dict:  # type: ignore[no-untyped-def]  # pragma: no cover - needs vLLM
    import torch

    from adapters.vllm.client import LlmLogProbs, greedy_tokens

    logp, _ = LlmLogProbs(llm)(torch.tensor(PROMPTS), 1.0)
    return {"logprobs": logp.tolist(), "greedy": greedy_tokens(llm, PROMPTS, NEW_TOKENS)}


def _worker_params(worker) -> dict:  # type: ignore[no-untyped-def]  # pragma: no cover - runs in vLLM's worker
    model = worker.get_model()
    return {n: (list(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in model.named_parameters()}


def _worker_kernels(worker) -> dict:  # type: ignore[no-untyped-def]  # pragma: no cover - runs in vLLM's worker
    found: dict[str, str] = {}
    for name, module in worker.get_model().named_modules():
        if ".layers.0." not in name + ".":
            continue
        method = getattr(module, "quant_method", None)
        scheme = getattr(module, "scheme", None)
        if method is None or type(method).__name__ in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"):
            continue
        parts = [type(scheme or method).__name__]
        for attr in ("kernel", "linear_kernel", "experts_cls", "mxfp4_backend", "nvfp4_backend", "fp8_backend"):
            value = getattr(scheme or method, attr, None)
            if value is not None:
                parts.append(getattr(value, "__name__", None) or getattr(value, "value", None) or type(value).__name__)
        found[name.rsplit(".", 1)[-1]] = "/".join(str(p) for p in parts)
    return found


def _decision(plan):  # type: ignore[no-untyped-def]  # pragma: no cover - needs CUDA
    import torch

    from adapters.profiles import backend_decision as decide_backends

    cap = torch.cuda.get_device_capability()
    # Below SM100 the gates refuse MX and NVFP4: decide without a capability (vLLM chooses).
    return decide_backends("vllm", plan, cap if cap >= (10, 0) else None)


def stage_cold(out: pathlib.Path, arm: str) -> dict:  # pragma: no cover - needs CUDA and vLLM
    import shutil

    from safetensors.torch import save_file

    from adapters.vllm.factory import vllm_environment

    exported, qc, plan = _export(out, arm)
    ckpt = out / f"{arm}-checkpoint"
    ckpt.mkdir(exist_ok=True)
    save_file({n: t.contiguous() for n, t in exported}, str(ckpt / "model.safetensors"))
    config = json.loads((out / "model" / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    for extra in ("generation_config.json",):
        if (out / "model" / extra).exists():
            shutil.copy(out / "model" / extra, ckpt / extra)
    decision = _decision(plan)
    os.environ.update(vllm_environment(decision))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    llm = LLM(**_llm_kwargs(ckpt), linear_backend=decision.linear.backend, moe_backend=decision.moe.backend)
    return {**_serve(llm), "kernels": llm.collective_rpc(_worker_kernels)[0]}


def stage_refit(out: pathlib.Path, arm: str) -> dict:  # pragma: no cover - needs CUDA and vLLM
    import torch

    from adapters.vllm.factory import vllm_engine_kwargs, vllm_environment
    from domain.errors import EngineStale
    from domain.refit.buckets import pack_buckets

    exported, qc, plan = _export(out, arm)
    decision = _decision(plan)
    os.environ.update(vllm_environment(decision))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # workers in this process: views reach them
    from vllm import LLM

    from adapters.vllm.client import LlmLogProbs, LlmWorkers
    from adapters.vllm.engine import VllmRolloutEngine

    kwargs = vllm_engine_kwargs(qc, decision, base={**_llm_kwargs(out / "model"), "load_format": "dummy"})
    llm = LLM(**kwargs)
    engine = VllmRolloutEngine(LlmWorkers(llm), LlmLogProbs(llm))
    try:
        engine.log_probs(torch.tensor(PROMPTS))
        stale_before = False
    except EngineStale:
        stale_before = True
    sent = {n: (list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in exported}
    refits, layout = [], None
    for refit_id in (1, 2):
        before = engine.storage_fingerprint()
        t0 = time.perf_counter()
        engine.begin_refit(refit_id)
        if layout is None:  # the checkpoint-format parameters, as the layerwise reload restored them
            layout = compare_layouts(engine_layout(sent), llm.collective_rpc(_worker_params)[0])
        for bucket in pack_buckets(iter(exported), 16 << 20, reuse_buffer=True):
            engine.load_bucket(bucket)
        result = engine.finalize_refit()
        refits.append({"seconds": time.perf_counter() - t0, "tensors": result.tensors_committed,
                       "storage_changed": before.differences(engine.storage_fingerprint())})
    return {**_serve(llm), "stale_before_refit": stale_before, "refits": refits, "layout": layout,
            "kernels": llm.collective_rpc(_worker_kernels)[0], "backends": decision.reasons()}


def child(stage: str, out: pathlib.Path) -> int:  # pragma: no cover - runs in the vLLM environment
    try:
        if stage == "model":
            stage_model(out)
            return 0
        arm, _, kind = stage.rpartition("-")
        result = stage_cold(out, arm) if kind == "cold" else stage_refit(out, arm)
    except Exception as err:  # reported by the orchestrator, which fails the check
        import traceback

        traceback.print_exc()
        result = {"error": f"{type(err).__name__}: {err}"[:2000]}
    (out / f"{stage}.json").write_text(json.dumps(result))
    return 0 if "error" not in result else 1


# --- orchestration (standard library only) -----------------------------------------------------------


def install(venv: pathlib.Path, wheelhouse: str | None) -> pathlib.Path:  # pragma: no cover - installs
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    cmd = [str(py), "-m", "pip", "install", "-q", f"vllm=={pinned_vllm()}", "attrs", "structlog"]
    if wheelhouse:
        cmd += ["--no-index", "--find-links", wheelhouse]
    subprocess.run(cmd, check=True)
    return py


def run_stages(me: list[str], stages: list[str], out: pathlib.Path, env: dict, deadline: float,
               parallel: int) -> dict[str, dict]:  # pragma: no cover - starts processes
    """Run the stages `parallel` at a time; a stage past the deadline is killed and recorded."""
    pending, running, results = list(stages), {}, {}
    while pending or running:
        while pending and len(running) < parallel:
            s = pending.pop(0)
            running[s] = subprocess.Popen([*me, s], env=env)
        for s, proc in list(running.items()):
            if proc.poll() is None and time.time() < deadline:
                continue
            if proc.poll() is None:
                proc.kill()
                (out / f"{s}.json").write_text(json.dumps({"error": "timed out"}))
            del running[s]
            f = out / f"{s}.json"
            results[s] = json.loads(f.read_text()) if f.exists() else {"error": f"no result (exit {proc.returncode})"}
        time.sleep(1)
    return results


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - the GPU check itself
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=None, help="an interpreter that already has the pinned vllm")
    ap.add_argument("--venv", default=str(ROOT / ".cache" / "vllm-gpu-venv"))
    ap.add_argument("--wheelhouse", default=None, help="install offline from the wheels in this directory")
    ap.add_argument("--skip-install", action="store_true", help="reuse the environment in --venv")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "out" / "gpu-support-matrix"))
    ap.add_argument("--timeout", type=float, default=400, help="seconds for the engine stages")
    ap.add_argument("--parallel", type=int, default=4, help="engines started at once")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.child:
        return child(args.child, out)
    t0 = time.time()
    if args.python:
        py = pathlib.Path(args.python)
    else:
        venv = pathlib.Path(args.venv)
        py = venv / "bin" / "python" if args.skip_install else install(venv, args.wheelhouse)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    me = [str(py), str(pathlib.Path(__file__).resolve()), "--out", str(out), "--child"]
    subprocess.run([*me, "model"], check=True, env=env, timeout=180)
    probe = subprocess.run([str(py), "-c", "import torch; print(*torch.cuda.get_device_capability())"],
                           capture_output=True, text=True, env=env, check=True)
    capability = [int(x) for x in probe.stdout.split()]
    stages = [f"{arm}-{kind}" for arm in ARMS for kind in ("cold", "refit")]
    results = run_stages(me, stages, out, env, time.time() + args.timeout, args.parallel)
    ok, lines = verdict(results, capability)
    summary = {"ok": ok, "capability": capability, "seconds": time.time() - t0, "lines": lines,
               "arms": {a: {"kernels": results.get(f"{a}-refit", {}).get("kernels"),
                            "backends": results.get(f"{a}-refit", {}).get("backends"),
                            "layout": results.get(f"{a}-refit", {}).get("layout")} for a in ARMS}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print("\n".join(lines))
    print(json.dumps({k: summary[k] for k in ("ok", "capability", "seconds")}))
    print(f"{'PASSED' if ok else 'FAILED'} in {summary['seconds']:.0f} s; details in {out / 'summary.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
