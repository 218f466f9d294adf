"""GPU check: ModelOpt QAT with NVFP4 / MX / FP8 block on CUDA, bit for bit against the exporter.

Run on a CUDA machine with nvidia-modelopt installed (the `modelopt` extra), from the repository
root (well under a minute on one GPU):

    python tests/gpu/check_modelopt_qat.py [--out DIR]

For every preset (FP8_BLOCK, MXFP8, MXFP4, NVFP4) and both weight numerics of
`ModelOptQatBackend` ("exporter": the exporter's codec inside ModelOpt's quantizers; "modelopt":
ModelOpt's own CUDA kernels), on a tiny Hugging Face-named model (separate q/k/v and gate/up, so
NVFP4 groups share a global scale) and on one large Linear:
- counts, per layer, the weight elements where ModelOpt's fake-quant differs from
  dequantize(exported tensors) (the independent reference: quantize_stream + dequantize_weight);
- counts the input elements where the input quantizer differs from the rollout's activation
  quantization (`fake_quantize_activation`: NVFP4 per token, MX dynamic, FP8 1x128);
- runs a forward and a backward, and records the verdict of the first-forward check
  (QatNumericsMismatch and the layer it named, or "pass").

Pass criteria (exit status 0): with exporter numerics every count is 0 and the check passes;
with ModelOpt numerics the check raises exactly when a weight count is non-zero, naming one of
those layers; gradients are finite. ModelOpt's own kernels differing from the exporter is
reported (it tells which numerics may train), not failed. Writes summary.json to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from domain.errors import QatNumericsMismatch
from domain.quant.codecs import fake_quantize_activation
from domain.quant.plan import QuantizationPlan
from tests.unit.qat_models import H, TinyHf, rollout_values

PRESETS = ("FP8_BLOCK", "MXFP8", "MXFP4", "NVFP4")
NUMERICS = ("exporter", "modelopt")


class _Big(torch.nn.Module):
    """One large Linear named like an HF down_proj (K = 2048, N = 1024)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.model.layers[0].mlp = torch.nn.Module()
        self.model.layers[0].mlp.down_proj = torch.nn.Linear(2048, 1024, bias=False)
        torch.nn.init.normal_(self.model.layers[0].mlp.down_proj.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.layers[0].mlp.down_proj(x)


def _diff(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.shape != b.shape or a.dtype != b.dtype:
        return a.numel()
    return int((a.view(torch.int16) != b.view(torch.int16)).sum())


def check_one(preset: str, numerics: str, model_kind: str, device: str = "cuda") -> dict[str, object]:
    """Apply ModelOpt QAT for one preset/numerics to one model; compare, train one step.

    Returns:
        A dict: per-layer weight and input mismatch counts, the check's verdict, grad finiteness.
    """
    from adapters.modelopt.backend import ModelOptQatBackend

    torch.manual_seed(0)
    model = (TinyHf(linear=torch.nn.Linear) if model_kind == "tiny" else _Big().to(torch.bfloat16)).to(device)
    width = H if model_kind == "tiny" else 2048
    plan = QuantizationPlan.from_presets(preset, None)
    want = rollout_values(plan, [(n, p.detach()) for n, p in model.named_parameters()])
    backend = ModelOptQatBackend(numerics=numerics)
    backend.apply(model, plan)
    x = torch.randn(8, width, device=device, dtype=torch.bfloat16) * torch.logspace(
        -2, 2, 8, device=device, dtype=torch.bfloat16)[:, None]
    weights, inputs = {}, {}
    with torch.no_grad():
        for name, m in model.named_modules():
            q = getattr(m, "weight_quantizer", None)
            if q is None or not q.is_enabled:
                continue
            weights[name] = _diff(q(m.weight), want[f"{name}.weight"])
            if m.in_features == width and m.input_quantizer.is_enabled:
                inputs[name] = _diff(m.input_quantizer(x), fake_quantize_activation(plan.effective_linear_activation, x))
    verdict, named = "pass", None
    try:
        model(x).float().square().mean().backward()
    except QatNumericsMismatch as err:
        verdict, named = "mismatch", err.layer.removesuffix(".weight")
    grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    differing = sorted(n for n, c in weights.items() if c)
    if numerics == "exporter":
        ok = not differing and not any(inputs.values()) and verdict == "pass" and grads_finite
    else:
        ok = (verdict == "mismatch") == bool(differing) and (named is None or named in differing)
    backend.remove(model)
    return {"preset": preset, "numerics": numerics, "model": model_kind, "weights_differ": weights,
            "inputs_differ": inputs, "check": verdict, "check_named": named, "grads_finite": grads_finite, "ok": ok}


def run_checks() -> list[dict[str, object]]:
    """Every preset x numerics x model; see the module docstring."""
    return [check_one(p, n, m) for p in PRESETS for n in NUMERICS for m in ("tiny", "big")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory for summary.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    results = run_checks()
    print(f"{'preset':10} {'numerics':9} {'model':5} {'weights differ':>15} {'inputs differ':>14} {'check':9} ok")
    for r in results:
        w = sum(r["weights_differ"].values())  # type: ignore[union-attr]
        i = sum(r["inputs_differ"].values())  # type: ignore[union-attr]
        print(f"{r['preset']:10} {r['numerics']:9} {r['model']:5} {w:>15} {i:>14} {r['check']:9} {r['ok']}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "summary.json").write_text(json.dumps(results, indent=2))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
