"""The prepared GPU check: what rl-refit does on a CUDA device, measured and compared, in one run.

Run from the repository root on a machine with one CUDA GPU (at most 8 minutes on an H200):

    PYTHONPATH=$PWD python tests/gpu/device_check.py --out device_check.json

It needs torch (with Triton, for the compiled codecs) and this repository's pure-Python modules,
which import `attrs` and `structlog`: where no package registry is reachable, carry their wheels
(`pip download --no-deps attrs structlog -d wheels`) and put them on the path
(`PYTHONPATH=$PWD:$(ls wheels/*.whl | tr '\\n' :)`). A missing one is named in the JSON and the
run stops before any phase. docs/benchmarks.md ("The GPU check") says how to read the result.

Phases, in order (`--phases` picks some); each one rewrites the JSON file when it ends, so a run
cut short still leaves what finished:

- bounds: device-to-device `copy_`, host-to-device from pinned and from pageable memory (GB/s).
- codecs: FP8_BLOCK, MXFP8, MXFP4, NVFP4 on adversarial blocks (zero, subnormal amax, ties,
  signed zero, five decades), eager and compiled: the bytes on the device equal the bytes on the
  host; the throughput of each on Qwen3-8B's Linear shapes against the device-to-device bound.
- refit: Qwen3-8B-shaped random weights made on the device, refitted into the embedded engine on
  the device (transaction and probe) in BF16, FP8_BLOCK, MXFP8 and NVFP4 weight-only: throughput
  against the bound, captured storage kept, and the stream's first layers equal byte for byte to
  the same stream exported on the host.
- ipc: a second process on the same GPU receives the refit's buckets through the CUDA IPC
  transport (the trainer's double buffer mapped once): throughput against the bound, digests equal.
- fused: fused log-probs at V = 151936, H = 4096, T up to 32768 against the materialized logits:
  peak allocator memory, log-prob and gradient error.
- gdn: tests/gpu/check_gdn_fla.py --quick, when `fla` imports.

`--dry-run` runs every phase on the CPU at tiny shapes (what `make test` runs: the plumbing, not
the figures; compiled codecs only with `--compiled`, compiling on a CPU takes about a minute).
Exit status: 0 when every phase that ran passed its checks, 1 otherwise, 2 when a dependency is
missing.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

NEEDS = ("attrs", "structlog")  # pure Python; everything else is torch, triton and this repository
PHASES = ("bounds", "codecs", "refit", "ipc", "fused", "gdn")
FORMATS = ("FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4")
REFIT_PRESETS = ("BF16", "FP8_BLOCK", "MXFP8", "NVFP4")
# Qwen3-8B: hidden 4096, 36 layers, 32 query / 8 key-value heads of 128, MLP 12288, vocab 151936
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                intermediate_size=12288)
TINY = dict(vocab_size=512, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
            intermediate_size=512)
# what the issue asks of an H200, as shares of the device-to-device copy rate (and of memory)
TARGETS = {"refit_bf16_share": 0.25, "ipc_share": 0.10, "fp8_block_quantize_share": 0.25, "fused_peak_share": 0.10}


class Check:
    """The run's JSON record: rewritten (atomically) whenever a phase ends."""

    def __init__(self, out: Path, args: argparse.Namespace) -> None:
        self.out = out
        self.data: dict[str, Any] = {
            "dry_run": args.dry_run, "device": args.device, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": _machine(args.device), "phases": {}, "targets": TARGETS, "needs": list(NEEDS), "missing": [],
        }

    def write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(self.out.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str) + "\n")
        tmp.replace(self.out)


def _machine(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node()}
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.device(device))
        info.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda,
                    capability=f"{p.major}.{p.minor}")
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    return info


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn: Callable[[], object], device: torch.device, repeat: int = 3) -> float:
    """Median wall seconds of fn() (its device work included), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, int]:
    """(equal, differing bytes) of two tensors compared on the host."""
    x = a.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    y = b.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    if x.numel() != y.numel() or a.dtype != b.dtype:
        return False, max(x.numel(), y.numel())
    differ = int((x != y).sum())
    return differ == 0, differ


# --- phases ------------------------------------------------------------------------------------


def d2d_gbps(ctx: dict[str, Any]) -> float:
    """The device-to-device copy rate the other phases are measured against: the bounds phase's,
    or (when it did not run) a copy of 256 MiB measured now."""
    if "d2d_gbps" not in ctx:
        device, nbytes = ctx["device"], min(ctx["bound_bytes"], 256 << 20)
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        ctx["d2d_gbps"] = nbytes / 1e9 / _seconds(lambda: dst.copy_(src), device)
    return float(ctx["d2d_gbps"])


def phase_bounds(ctx: dict[str, Any]) -> dict[str, Any]:
    device, nbytes = ctx["device"], ctx["bound_bytes"]
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    d2d = nbytes / 1e9 / _seconds(lambda: dst.copy_(src), device)
    ctx["d2d_gbps"] = d2d
    out: dict[str, Any] = {"bytes": nbytes, "d2d_copy_gbps": d2d}
    if device.type != "cuda":
        out["h2d"] = "not measured: no CUDA device (dry run)"
        return out
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    out["h2d_pinned_gbps"] = nbytes / 1e9 / _seconds(lambda: dst.copy_(pinned, non_blocking=True), device)
    out["h2d_pageable_gbps"] = nbytes / 1e9 / _seconds(lambda: dst.copy_(pageable), device)
    out["d2h_pinned_gbps"] = nbytes / 1e9 / _seconds(lambda: pinned.copy_(dst, non_blocking=True), device)
    return out


def adversarial_weight(rows: int = 256, cols: int = 1024) -> torch.Tensor:
    """A bf16 [rows, cols] weight whose 128x128 regions hold what breaks codecs: zeros, a subnormal
    amax, E4M3 ties, E2M1 ties, signed zeros, five decades in one block; Gaussian elsewhere."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(rows, cols, generator=g)
    regions = [w[r : r + 128, c : c + 128] for r in range(0, rows, 128) for c in range(0, cols, 128)]
    regions[0].zero_()
    regions[1].copy_(torch.randn(128, 128, generator=g) * 1e-39)  # subnormal in fp32, at bf16's edge
    e4m3_ties = torch.tensor([1.0625, -1.1875, 2.125, 0.53125, 0.0703125, -3.25, 5.5, 448.0])
    regions[2].copy_(e4m3_ties.repeat(128, 16))  # amax 448: scale 1, each other value a midpoint of E4M3
    e2m1_ties = torch.tensor([0.25, -0.75, 1.25, 1.75, 2.5, -3.5, 5.0, 6.0])
    regions[3].copy_(e2m1_ties.repeat(128, 16))  # amax 6: scale 1, midpoints of E2M1
    signed = torch.randn(128, 128, generator=g) * 1e-3
    signed[:, ::2] = -0.0
    regions[4].copy_(signed)
    decades = 10.0 ** torch.empty(128, 128).uniform_(-3, 2, generator=g)
    regions[5].copy_(decades * torch.sign(torch.randn(128, 128, generator=g)))
    return w.to(torch.bfloat16)


def phase_codecs(ctx: dict[str, Any]) -> dict[str, Any]:
    from domain.quant.codecs import compile as kernels
    from domain.quant.codecs import quantize_weight
    from domain.quant.formats import FORMATS as ALL

    device = ctx["device"]
    w_host = adversarial_weight()
    w_dev = w_host.to(device)
    modes = ("eager", "compiled") if ctx["compiled"] else ("eager",)
    out: dict[str, Any] = {"compared": f"{device} against the host" if device.type != "cpu" else
                           "cpu against cpu (dry run: the comparison's plumbing, not a device)", "bytes": {}}
    if not ctx["compiled"]:
        out["compiled"] = "not run (dry run: compiling on a CPU takes about a minute; --compiled runs it)"
    ok = True
    for mode in modes:
        kernels.set_compiled(mode == "compiled")
        try:
            for name in FORMATS:
                fmt = ALL[name]
                host = quantize_weight(fmt, w_host).tensors
                dev = quantize_weight(fmt, w_dev).tensors
                cells = {k: _same_bytes(dev[k], host[k]) for k in host}
                equal = all(e for e, _ in cells.values()) and set(dev) == set(host)
                ok &= equal
                out["bytes"][f"{name} {mode}"] = {"equal": equal, "differing_bytes": {k: d for k, (_, d) in cells.items()}}
        finally:
            kernels.set_compiled(False)
    out["throughput"] = _codec_throughput(ctx, modes[-1])
    fp8 = out["throughput"].get("FP8_BLOCK", {}).get("share_of_d2d")
    out["passed"] = ok
    if fp8 is not None and device.type == "cuda":
        out["fp8_block_meets_target"] = fp8 >= TARGETS["fp8_block_quantize_share"]
    return out


def _codec_throughput(ctx: dict[str, Any], mode: str) -> dict[str, Any]:
    """Each format over the distinct Linear shapes of one layer (Qwen3-8B's, or the tiny model's)."""
    from domain.quant.codecs import compile as kernels
    from domain.quant.codecs import quantize_weight
    from domain.quant.formats import FORMATS as ALL

    device, m = ctx["device"], ctx["model"]
    h, q, kv, inter = m["hidden_size"], m["num_heads"] * m["head_dim"], m["num_kv_heads"] * m["head_dim"], m["intermediate_size"]
    shapes = [(q, h), (kv, h), (h, q), (inter, h), (h, inter)]
    weights = [torch.randn(s, device=device, dtype=torch.bfloat16) for s in shapes]
    gbytes = sum(w.numel() * 2 for w in weights) / 1e9
    out: dict[str, Any] = {"mode": mode, "shapes": shapes, "source_gbytes": gbytes}
    kernels.set_compiled(mode == "compiled")
    try:
        for name in FORMATS:
            fmt = ALL[name]
            s = _seconds(lambda fmt=fmt: [quantize_weight(fmt, w) for w in weights], device)
            out[name] = {"gbps": gbytes / s, "share_of_d2d": gbytes / s / d2d_gbps(ctx)}
    finally:
        kernels.set_compiled(False)
    return out


def _trainer(ctx: dict[str, Any]) -> Any:
    """A reference trainer of the check's model shapes, its random weights made on the device."""
    from adapters.reference.config import ReferenceModelConfig
    from adapters.reference.model import fused_shapes
    from adapters.reference.trainer import ReferenceTrainer

    cfg = ReferenceModelConfig(**ctx["model"])
    device = ctx["device"]
    g = torch.Generator(device=device).manual_seed(0)
    weights = {}
    for key, shape in fused_shapes(cfg).items():
        leaf = key.rsplit(".", 1)[-1]
        noise = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        weights[key] = 1.0 + 0.1 * noise if len(shape) == 1 else noise * (1.0 if leaf == "embed" else 0.02)
    return ReferenceTrainer(cfg, weights)


def phase_refit(ctx: dict[str, Any]) -> dict[str, Any]:
    from adapters.reference.engine import ReferenceEngine
    from app.services.refit import RefitService
    from app.services.verification import PostRefitProbe, TrainerReference
    from domain.quant.formats import ActivationScheme
    from domain.quant.plan import QuantizationPlan
    from domain.quant.stream import quantize_stream

    device = ctx["device"]
    trainer = _trainer(ctx)
    ids = torch.randint(0, trainer.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    out: dict[str, Any] = {}
    ok = True
    for preset in REFIT_PRESETS:
        if preset == "BF16":
            plan = QuantizationPlan.bf16()
        else:  # weight-only: the activations stay as they are, so the probe compares the weights' rounding alone
            plan = QuantizationPlan.from_presets(preset, None, linear_activation=ActivationScheme.NONE)
        engine = ReferenceEngine(trainer.config, plan, device=device)
        before = engine.storage_fingerprint()
        svc = RefitService(trainer, engine, plan, bucket_bytes=ctx["bucket_bytes"],
                           probe=PostRefitProbe(TrainerReference(trainer), ids))
        first = svc.refit()
        seconds = _seconds(svc.refit, device, repeat=ctx["repeat"])
        last = svc.reports[-1]
        gbytes = first.source_bytes / 1e9
        exported = quantize_stream(plan, trainer.named_weights())
        host = quantize_stream(plan, ((n, t.cpu()) for n, t in trainer.named_weights()))
        compared, equal = 0, True
        for (name, a), (name_h, b) in zip(exported, host, strict=False):
            if not name.startswith(("model.embed", "model.layers.0.", "model.layers.1.")):
                break
            equal &= name == name_h and _same_bytes(a, b)[0]
            compared += 1
        cell = {
            "outcome": last.outcome.value, "storage_kept": last.storage.ok and engine.storage_fingerprint() == before,
            "probe": str(last.probe) if getattr(last, "probe", None) is not None else None,
            "seconds": seconds, "gbps": gbytes / seconds, "share_of_d2d": gbytes / seconds / d2d_gbps(ctx),
            "source_gbytes": gbytes, "phases": {k: round(v, 4) for k, v in last.timings.items()},
            "first_layers_equal_host_export": equal, "tensors_compared": compared,
        }
        ok &= cell["outcome"] == "live" and cell["storage_kept"] and equal and compared > 0
        out[preset] = cell
        del svc, engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["passed"] = ok
    if device.type == "cuda":
        out["bf16_meets_target"] = out["BF16"]["share_of_d2d"] >= TARGETS["refit_bf16_share"]
    return out


def _ipc_receiver(transport: str, rendezvous: dict[str, Any], shapes: list[tuple[str, list[int]]], device: str,
                  bucket_bytes: int, results: Any) -> None:
    """The second process: join the stream, copy each tensor into its own, digest them."""
    sys.path.insert(0, str(ROOT))
    from adapters.distributed.transports import join_transport
    from domain.refit.buckets import unpack_bucket
    from domain.refit.storage import tensor_digest

    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        kept = {name: torch.empty(shape, dtype=torch.bfloat16, device=device) for name, shape in shapes}
        link = join_transport(transport, rendezvous, 1, bucket_bytes)

        def consume(bucket: Any) -> None:
            for name, t in unpack_bucket(bucket):
                kept[name].copy_(t)

        stats = link.transport.receive(consume)
        link.close()
        results.put({"digests": {n: tensor_digest(t) for n, t in kept.items()}, "buckets": stats.buckets})
    except BaseException as err:  # reported to the parent
        results.put({"error": f"{type(err).__name__}: {err}"})


def phase_ipc(ctx: dict[str, Any]) -> dict[str, Any]:
    import multiprocessing as mp

    from adapters.distributed.transports import offer_transport
    from domain.refit.buckets import BucketPlanner
    from domain.refit.storage import tensor_digest

    device = ctx["device"]
    transport = "cuda_ipc" if device.type == "cuda" else "shm"
    trainer = _trainer(ctx)
    layers = ("model.layers.0.", "model.layers.1.", "model.layers.2.", "model.layers.3.")
    named = [(n, t) for n, t in trainer.named_weights() if n.startswith(layers)]
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    offer = offer_transport(transport, 1, ctx["bucket_bytes"], device=device, timeout_s=120)
    child = spawn.Process(target=_ipc_receiver, args=(transport, offer.rendezvous, [(n, list(t.shape)) for n, t in named],
                                                      str(device), ctx["bucket_bytes"], results))
    child.start()
    try:
        link = offer.accept()
        planner = BucketPlanner(ctx["bucket_bytes"], by_reference=True)
        _sync(device)
        t0 = time.perf_counter()
        stats = link.transport.send(planner.pack(named))
        seconds = time.perf_counter() - t0
        got = results.get(timeout=120)
        link.close()
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()
    if "error" in got:
        return {"transport": transport, "passed": False, "error": got["error"]}
    expected = {n: tensor_digest(t) for n, t in named}
    gbytes = stats.payload_bytes / 1e9
    out = {"transport": transport if device.type == "cuda" else "shm (dry run: no CUDA IPC on a CPU)",
           "buckets": stats.buckets, "gbytes": gbytes, "seconds": seconds, "gbps": gbytes / seconds,
           "share_of_d2d": gbytes / seconds / d2d_gbps(ctx), "digests_equal": got["digests"] == expected}
    out["passed"] = out["digests_equal"]
    if device.type == "cuda":
        out["meets_target"] = out["share_of_d2d"] >= TARGETS["ipc_share"]
    return out


def phase_fused(ctx: dict[str, Any]) -> dict[str, Any]:
    from domain.forward.fused_logprob import fused_logprob_entropy, reference_logprob_entropy

    device = ctx["device"]
    vocab, hidden = ctx["fused_vocab"], ctx["fused_hidden"]
    g = torch.Generator(device=device).manual_seed(3)
    weight = (torch.randn(vocab, hidden, generator=g, device=device) * 0.02).to(torch.bfloat16).requires_grad_()
    out: dict[str, Any] = {"vocab": vocab, "hidden": hidden, "tokens": {}}

    def run(fn: Callable[..., Any], tokens: int) -> tuple[Any, int | None]:
        h = torch.randn(tokens, hidden, generator=g, device=device).to(torch.bfloat16).requires_grad_()
        y = torch.randint(0, vocab, (tokens,), generator=g, device=device)
        weight.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        logp, ent = fn(h, weight, y)
        (logp.sum() + ent.sum()).backward()
        peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
        return (logp.detach(), ent.detach(), h.grad, weight.grad.clone()), peak  # type: ignore[union-attr]

    per_token: float | None = None  # the materialized path's peak bytes per token, from the largest T that fit
    for tokens in ctx["fused_tokens"]:
        cell: dict[str, Any] = {}
        g.manual_seed(tokens)
        fused, cell["fused_peak_bytes"] = run(lambda h, w, y: fused_logprob_entropy(h, w, y), tokens)
        g.manual_seed(tokens)
        try:
            plain, cell["materialized_peak_bytes"] = run(lambda h, w, y: reference_logprob_entropy(h, w, y), tokens)
        except torch.OutOfMemoryError:
            plain = None
            cell["materialized_peak_bytes"] = None
            cell["materialized"] = "out of memory"
        cell["logits_bytes"] = tokens * vocab * 4
        if plain is not None:
            cell["logprob_max_abs_err"] = float((fused[0] - plain[0]).abs().max())
            cell["entropy_max_abs_err"] = float((fused[1] - plain[1]).abs().max())
            cell["grad_hidden_rel_err"] = float((fused[2].float() - plain[2].float()).norm() / plain[2].float().norm())
            cell["grad_weight_rel_err"] = float((fused[3].float() - plain[3].float()).norm() / plain[3].float().norm())
        if cell["materialized_peak_bytes"] is not None:
            per_token = cell["materialized_peak_bytes"] / tokens
        elif per_token is not None:  # it did not fit: its peak grows with T (the logits and their gradient)
            cell["materialized_peak_estimate_bytes"] = int(per_token * tokens)
        if cell["fused_peak_bytes"] is not None:
            materialized = (cell["materialized_peak_bytes"] or cell.get("materialized_peak_estimate_bytes")
                            or cell["logits_bytes"])
            cell["peak_share"] = cell["fused_peak_bytes"] / materialized
            cell["peak_share_against"] = ("measured" if cell["materialized_peak_bytes"] else
                                          "estimated from the largest T that fit" if "materialized_peak_estimate_bytes"
                                          in cell else "the float32 logits alone (a lower bound)")
        out["tokens"][str(tokens)] = cell
        del fused, plain
    errors = [c for c in out["tokens"].values() if "logprob_max_abs_err" in c]
    out["passed"] = bool(errors) and all(c["logprob_max_abs_err"] < 1e-2 and c["grad_hidden_rel_err"] < 2e-2 and
                                         c["grad_weight_rel_err"] < 2e-2 for c in errors)
    last = out["tokens"][str(max(ctx["fused_tokens"]))]
    if device.type == "cuda" and "peak_share" in last:
        out["meets_target"] = last["peak_share"] <= TARGETS["fused_peak_share"]
    return out


def phase_gdn(ctx: dict[str, Any]) -> dict[str, Any]:
    if ctx["device"].type != "cuda":
        return {"skipped": "no CUDA device (dry run): fla's kernels need one"}
    try:
        importlib.import_module("fla")
    except ImportError as err:
        return {"skipped": f"fla does not import ({err}); carry flash-linear-attention to run it"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests/gpu/check_gdn_fla.py"), "--quick"], capture_output=True,
                          text=True, timeout=240, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    return {"passed": proc.returncode == 0, "returncode": proc.returncode, "output_tail": proc.stdout[-3000:] + proc.stderr[-1000:]}


RUN: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "bounds": phase_bounds, "codecs": phase_codecs, "refit": phase_refit, "ipc": phase_ipc, "fused": phase_fused,
    "gdn": phase_gdn,
}


def context(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    if args.dry_run:
        return {"device": device, "model": TINY, "bound_bytes": 4 << 20, "bucket_bytes": 1 << 20, "repeat": 1,
                "fused_vocab": 1000, "fused_hidden": 64, "fused_tokens": (64, 256), "compiled": args.compiled}
    return {"device": device, "model": QWEN3_8B, "bound_bytes": 2 << 30, "bucket_bytes": 512 << 20, "repeat": 2,
            "fused_vocab": 151936, "fused_hidden": 4096, "fused_tokens": (4096, 32768), "compiled": True}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default="device_check.json", help="the JSON file (rewritten after every phase)")
    parser.add_argument("--dry-run", action="store_true", help="every phase on the CPU at tiny shapes")
    parser.add_argument("--compiled", action="store_true", help="with --dry-run: the compiled codecs too")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --dry-run")
    parser.add_argument("--budget-s", type=float, default=450.0, help="phases not started by then are skipped")
    args = parser.parse_args(argv)
    args.device = args.device or ("cpu" if args.dry_run else "cuda")
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        parser.error(f"unknown phases {unknown}; choose from {', '.join(PHASES)}")
    check = Check(Path(args.out), args)
    check.data["missing"] = [m for m in NEEDS if importlib.util.find_spec(m) is None]
    if check.data["missing"]:
        check.data["error"] = (f"missing {', '.join(check.data['missing'])}: carry the wheels (pip download --no-deps "
                               f"{' '.join(check.data['missing'])} -d wheels) and put them on PYTHONPATH")
        check.write()
        print(check.data["error"], file=sys.stderr)
        return 2
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        check.data["error"] = "no CUDA device: run with --dry-run on a CPU"
        check.write()
        print(check.data["error"], file=sys.stderr)
        return 2
    if torch.device(args.device).type == "cuda":
        torch.cuda.set_device(torch.device(args.device))
    import logging

    from app.logging import configure_logging

    configure_logging(level=logging.WARNING)  # one line per refit would bury the phases' lines
    ctx = context(args)
    check.data["shapes"] = {k: v for k, v in ctx.items() if k != "device"}
    start = time.perf_counter()
    failed = False
    for name in phases:
        if time.perf_counter() - start > args.budget_s:
            check.data["phases"][name] = {"skipped": f"the time budget ({args.budget_s:.0f} s) was spent"}
            check.write()
            continue
        t0 = time.perf_counter()
        try:
            result = RUN[name](ctx)
        except Exception as err:  # the phase's failure is a finding; the next phases still run
            result = {"passed": False, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
        result["seconds_total"] = round(time.perf_counter() - t0, 2)
        failed |= result.get("passed") is False
        check.data["phases"][name] = result
        check.data["elapsed_s"] = round(time.perf_counter() - start, 1)
        check.write()
        print(f"{name}: {'FAIL' if result.get('passed') is False else 'ok'} ({result['seconds_total']} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
