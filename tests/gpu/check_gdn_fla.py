"""GPU check: fla's varlen GDN kernels on a packed batch against the per-sequence reference.

Run on a CUDA machine with flash-linear-attention installed, from the repository root:

    python tests/gpu/check_gdn_fla.py            # full check (a couple of minutes at most)
    python tests/gpu/check_gdn_fla.py --quick    # small shapes only

For each packed batch it prints the max abs difference between the candidate kernels (fla's
`causal_conv1d(cu_seqlens=...)` and `chunk_gated_delta_rule(cu_seqlens=...)`, and
causal-conv1d's `causal_conv1d_fn(seq_idx=...)` when installed) on the whole packed batch and
the plain-torch reference run on each sequence alone, forward and backward. Next to it, the
"leak" column is what ignoring the boundaries would cost, so the check is seen to discriminate.
It also checks that building `seq_idx` makes no device-to-host synchronization
(`torch.cuda.set_sync_debug_mode("error")`). Exit status 0 when every check passes.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from adapters.megatron.gdn_kernels import GdnKernels, select_kernels
from domain.forward import varlen_kernels
from domain.forward.gdn_packing import build_seq_idx, sequence_starts

# Bound on the error ratio rms(candidate - reference) / rms(reference), the measure fla's own
# tests use: fp32 inputs still meet TF32 matrix products inside the Triton kernels.
TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 2e-2}


@attrs.frozen
class Result:
    """One comparison. `leak`: max abs difference had the boundaries been ignored (forward only)."""

    name: str
    max_abs_diff: float
    err_ratio: float
    leak: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.err_ratio <= self.tolerance

    def line(self) -> str:
        status = "ok  " if self.ok else "FAIL"
        return (
            f"{status} {self.name:<52} max_abs_diff={self.max_abs_diff:.3e}  "
            f"err_ratio={self.err_ratio:.2e}  leak={self.leak:.3e}"
        )


def compare(
    name: str, got: torch.Tensor, want: torch.Tensor, tolerance: float, leak: float = float("nan")
) -> Result:
    got, want = got.detach().float(), want.detach().float()
    if got.shape != want.shape:
        raise ValueError(f"{name}: shape {tuple(got.shape)} != reference {tuple(want.shape)}")
    if want.numel() == 0:
        return Result(name, 0.0, 0.0, leak, tolerance)
    err = got - want
    ratio = float(err.square().mean().sqrt() / want.square().mean().sqrt().clamp_min(1e-12))
    return Result(name, float(err.abs().max()), ratio, leak, tolerance)


def layout(seed: int, count: int, max_len: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (count,), generator=gen)
    zero = torch.zeros(1, dtype=torch.int64)
    return torch.cat([zero, lengths.cumsum(0)]).to(torch.int32).to(device)


def _pieces(x: torch.Tensor, cu: list[int]) -> list[torch.Tensor]:
    return [x[:, a:b] for a, b in itertools.pairwise(cu)]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def check_conv(kernels: GdnKernels, cu: torch.Tensor, channels: int, dtype: torch.dtype) -> list[Result]:
    total, device = int(cu[-1]), cu.device
    bounds = cu.tolist()
    x = torch.randn(1, total, channels, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(channels, 4, device=device) / 2).to(dtype).requires_grad_()
    bias = torch.randn(channels, device=device).to(dtype).requires_grad_()
    grad_out = torch.randn(1, total, channels, device=device).to(dtype)

    out = kernels.conv(x, weight, bias, "silu", cu, build_seq_idx(cu, total))
    (dx,) = torch.autograd.grad(out, (x,), grad_out)

    ref, ref_dx = [], []
    for xs, gs in zip(_pieces(x.detach().float(), bounds), _pieces(grad_out.float(), bounds), strict=True):
        xs = xs.clone().requires_grad_()
        r = varlen_kernels.causal_conv1d(xs, weight.detach().float(), bias.detach().float(), "silu")
        ref.append(r.detach())
        ref_dx.append(torch.autograd.grad(r, (xs,), gs)[0])
    ref_out, ref_grad = torch.cat(ref, 1), torch.cat(ref_dx, 1)
    joined = varlen_kernels.causal_conv1d(
        x.detach().float(), weight.detach().float(), bias.detach().float(), "silu"
    )
    tol = TOLERANCE[dtype]
    tag = f"{kernels.name} conv {str(dtype).removeprefix('torch.')} T={total} D={channels}"
    return [
        compare(f"{tag} fwd", out, ref_out, tol, _diff(joined, ref_out)),
        compare(f"{tag} dx", dx, ref_grad, tol),
    ]


def check_rule(
    kernels: GdnKernels, cu: torch.Tensor, heads: int, k_dim: int, v_dim: int, dtype: torch.dtype
) -> list[Result]:
    total, device = int(cu[-1]), cu.device
    bounds = cu.tolist()
    q = torch.randn(1, total, heads, k_dim, device=device)
    k = F.normalize(torch.randn(1, total, heads, k_dim, device=device), dim=-1)
    v = torch.randn(1, total, heads, v_dim, device=device)
    g = F.logsigmoid(torch.randn(1, total, heads, device=device) + 2.0)
    beta = torch.rand(1, total, heads, device=device)
    # As Megatron-Core feeds them: g (the log decay) in fp32, the rest in the model dtype.
    inputs = [t.to(torch.float32 if t is g else dtype).requires_grad_() for t in (q, k, v, g, beta)]
    grad_out = torch.randn(1, total, heads, v_dim, device=device).to(dtype)

    out = kernels.gated_delta_rule(*inputs, cu)
    grads = torch.autograd.grad(out, inputs, grad_out)

    ref, ref_grads = [], [[] for _ in inputs]
    split = [_pieces(t.detach().float(), bounds) for t in inputs]
    for i, gs in enumerate(_pieces(grad_out.float(), bounds)):
        alone = [s[i].clone().requires_grad_() for s in split]
        r = varlen_kernels.gated_delta_rule(*alone)
        ref.append(r.detach())
        for acc, grad in zip(ref_grads, torch.autograd.grad(r, alone, gs), strict=True):
            acc.append(grad)
    ref_out = torch.cat(ref, 1)
    joined = varlen_kernels.gated_delta_rule(*(t.detach().float() for t in inputs))
    tol = TOLERANCE[dtype]
    tag = f"{kernels.name} rule {str(dtype).removeprefix('torch.')} T={total} H={heads} K={k_dim} V={v_dim}"
    results = [compare(f"{tag} fwd", out, ref_out, tol, _diff(joined, ref_out))]
    for name, got, parts in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, ref_grads, strict=True):
        results.append(compare(f"{tag} {name}", got, torch.cat(parts, 1), tol))
    return results


def check_no_host_sync(device: torch.device) -> Result:
    cu = layout(0, 16, 64, device)
    total = int(cu[-1])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        seq_idx = build_seq_idx(cu, total)
        sequence_starts(seq_idx)
        synced = 0.0
    except RuntimeError:
        synced = 1.0
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return Result("build_seq_idx without host sync", synced, synced, float("nan"), 0.0)


def run_checks(
    *, device: str | torch.device = "cuda", kernels: GdnKernels | None = None, quick: bool = False
) -> list[Result]:
    """Every comparison; `kernels` default: fla's, then causal-conv1d's convolution if installed."""
    device = torch.device(device)
    candidates = [kernels] if kernels is not None else [select_kernels("fla")]
    if kernels is None:
        try:
            candidates.append(select_kernels("causal_conv1d"))
        except ModuleNotFoundError:
            print("causal-conv1d is not installed: its fallback convolution is not checked")
    torch.manual_seed(0)
    shapes = [(0, 6, 64, 48, 2, 16, 16)]  # seed, sequences, max length, conv channels, H, K, V
    if not quick:
        shapes += [(1, 12, 64, 384, 4, 64, 64), (2, 8, 1024, 1024, 8, 128, 128)]
    results = []
    for seed, count, max_len, channels, heads, k_dim, v_dim in shapes:
        cu = layout(seed, count, max_len, device)
        for dtype in (torch.float32, torch.bfloat16):
            for candidate in candidates:
                results += check_conv(candidate, cu, channels, dtype)
            results += check_rule(candidates[0], cu, heads, k_dim, v_dim, dtype)
    if device.type == "cuda":
        results.append(check_no_host_sync(device))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes only")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("check_gdn_fla: needs a CUDA device", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        results = run_checks(quick=args.quick)
    except ModuleNotFoundError as err:
        print(f"check_gdn_fla: {err}", file=sys.stderr)
        return 2
    for result in results:
        print(result.line())
    failed = [r for r in results if not r.ok]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed in {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
