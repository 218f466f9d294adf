"""Tiny torch models with Hugging Face names for the QAT tests, and the tests' independent reference.

`TinyHf` has a dense layer (q/k/v/o, gate/up/down as separate nn.Linear modules) and an MoE layer
(a router and fused 3-D experts `gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I], as transformers
5 stores them). Every module records the weights its forward computed with and the inputs it got.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from domain.quant import naming
from domain.quant.codecs import QuantizedWeight, dequantize_weight
from domain.quant.plan import QuantizationPlan
from domain.quant.stream import quantize_stream

H, Q, KV, INTER, EXPERTS, MOE_INTER = 64, 64, 32, 64, 2, 32


class RecLinear(nn.Linear):
    """nn.Linear that records the weight and the input its forward used."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen_weight = self.weight.detach().clone()
        self.seen_input = x.detach().clone()
        return super().forward(x)


class Experts(nn.Module):
    """Fused 3-D experts; every token goes to every expert (routing is not what is tested)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * MOE_INTER, H) * 0.05)
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, H, MOE_INTER) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen_input = x.detach().clone()
        self.seen_weight = {"gate_up_proj": self.gate_up_proj.detach().clone(), "down_proj": self.down_proj.detach().clone()}
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            out = out + F.linear(F.silu(gate) * up, self.down_proj[e])
        return out


# The Linear class the tiny models use: RecLinear records; plain nn.Linear is what ModelOpt converts.
LINEAR: list[type[nn.Linear]] = [RecLinear]


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return LINEAR[0](n_in, n_out, bias=False)


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = _linear(H, Q), _linear(H, KV), _linear(H, KV)
        self.o_proj = _linear(Q, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, v = self.k_proj(x), self.v_proj(x)
        return self.o_proj(self.q_proj(x) + torch.cat((k, v), dim=-1))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = _linear(H, INTER), _linear(H, INTER)
        self.down_proj = _linear(INTER, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = _linear(H, EXPERTS)
        self.experts = Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x) + self.gate(x).sum(-1, keepdim=True)


class Layer(nn.Module):
    def __init__(self, moe: bool) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(H)
        self.self_attn = Attn()
        self.mlp = Moe() if moe else Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(x)


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(False), Layer(True)])


class TinyHf(nn.Module):
    """`model.layers.{0,1}...` and `lm_head`, like a transformers causal LM's parameters."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16, seed: int = 0, linear: type[nn.Linear] = RecLinear) -> None:
        super().__init__()
        torch.manual_seed(seed)
        LINEAR[0] = linear
        try:
            self.model = Inner()
            self.lm_head = _linear(H, 32)
        finally:
            LINEAR[0] = RecLinear
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, 0.05)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(x)


def rollout_values(plan: QuantizationPlan, named: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """dequantize(exported checkpoint tensors), written from the spec: what the rollout decodes."""
    ckpt = dict(quantize_stream(plan, named))
    out = {}
    for name, w in named:
        d = plan.decide(name, tuple(w.shape))
        if not d.is_quantized:
            out[name] = w.detach()
            continue
        split = (naming.expert_split(name, tuple(w.shape)) if w.dim() == 3
                 else [(naming.module_name(name), None, slice(0, w.shape[0]))])
        full = torch.empty_like(w)
        for module, e, rows in split:
            tensors = {local: ckpt[f"{module}.{plan.scale_name if local == 'weight_scale' else local}"]
                       for local in d.format.tensor_names}
            shape = (rows.stop - rows.start, w.shape[-1])
            value = dequantize_weight(QuantizedWeight(d.format, tensors, shape, w.dtype), w.dtype)
            if e is None:
                full[rows] = value
            else:
                full[e, rows] = value
        out[name] = full
    return out


class LinearCalls(TorchFunctionMode):
    """Records (input, weight) of every F.linear call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is F.linear:
            self.calls.append((args[0].detach().clone(), args[1].detach().clone()))
        return func(*args, **(kwargs or {}))
