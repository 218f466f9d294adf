"""A CPU fake of the SGLang objects a refit touches, shaped like SGLang 0.5.23's.

- `FakeSglangEngine` has SGLang's weight-update session: `begin_weight_update` (each quant
  method's `restore_weights_before_loading`), `update_weights_from_tensor(named, load_format,
  flush_cache)` (a `custom_weight_loader` path is imported and called as `loader(model, named)`;
  exceptions propagate, as in SGLang), `end_weight_update` (every quant method's
  `process_weights_after_loading`, as `DefaultModelLoader.postprocess_weights` does).
- `FakeSglangModel.load_weights` maps checkpoint names onto fused parameters (q/k/v ->
  `qkv_proj`; experts -> `w13_*` / `w2_*` [E, ...]). Native MXFP8 layers only know
  `weight_scale_inv`. The FP4 fused-MoE loader, like SGLang's, needs every expert tensor of a
  layer in one call.
- Post-processing rebinds: MXFP8 linears get a new `weight` object and a row-swizzled scale
  assigned to `.data`; FP4 MoE layers get their experts reordered into new storage.
- Besides the weights a refit sends, the model holds what it never sends: a rotary cos/sin
  cache buffer and a vision tower's patch embedding (frozen, not refitted).
"""

from __future__ import annotations

import torch
from torch import nn

H, INTER, EXPERTS, VOCAB, LAYERS = 64, 64, 4, 32, 2
ROTARY_POSITIONS = 256
# Engine tensors no refit writes (the rotary cache, the frozen vision tower).
UNSENT = ("rotary_emb.", "vision_tower.")
LOCALS = {"MXFP8": ("weight", "weight_scale_inv"), "MXFP4": ("weight_packed", "weight_scale")}


def swizzle(scale: torch.Tensor) -> torch.Tensor:
    """The fake kernel layout of an MXFP8 scale: rows reversed (a stand-in for SGLang's swizzle)."""
    return torch.flip(scale, dims=[0]).contiguous()


class FakeUnquantizedMethod:
    def __init__(self) -> None:
        self.calls = 0
        self.restores = 0

    def restore_weights_before_loading(self, layer: nn.Module) -> None:
        self.restores += 1

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.calls += 1


class FakeMxfp8LinearMethod(FakeUnquantizedMethod):
    fail = False  # set on an instance to make its post-processing raise
    reshape = False  # set to make it change the scale's shape (breaks captured storage)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.calls += 1
        if self.fail:
            raise RuntimeError("injected post-processing failure")
        layer.weight = nn.Parameter(layer.weight.data.clone(), requires_grad=False)
        scale = layer.weight_scale_inv
        scale.data = swizzle(scale.data) if not self.reshape else scale.data.reshape(-1).clone()


class FakeFp4MoeMethod(FakeUnquantizedMethod):
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.calls += 1
        for name in ("w13_weight_packed", "w2_weight_packed"):
            setattr(layer, name, nn.Parameter(torch.flip(getattr(layer, name).data, dims=[0]), requires_grad=False))
        for name in ("w13_weight_scale", "w2_weight_scale"):
            p = getattr(layer, name)
            p.data = torch.flip(p.data, dims=[0]).contiguous()


def _zeros(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)


class FakeLinear(nn.Module):
    def __init__(self, shards: int, k: int, fmt: str | None) -> None:
        super().__init__()
        n = shards * H
        if fmt == "MXFP8":
            self.weight = _zeros(n, k, dtype=torch.float8_e4m3fn)
            self.weight_scale_inv = _zeros(n, k // 32, dtype=torch.uint8)
            self.quant_method: FakeUnquantizedMethod = FakeMxfp8LinearMethod()
        else:
            self.weight = _zeros(n, k, dtype=torch.bfloat16)
            self.quant_method = FakeUnquantizedMethod()

    def load_shard(self, local: str, t: torch.Tensor, shard: int) -> None:
        param = getattr(self, local)
        rows = t.shape[0]
        param.data[shard * rows:(shard + 1) * rows].copy_(t)


class FakeFusedMoE(nn.Module):
    def __init__(self, fmt: str | None) -> None:
        super().__init__()
        self.fmt = fmt
        if fmt == "MXFP4":
            self.w13_weight_packed = _zeros(EXPERTS, 2 * INTER, H // 2, dtype=torch.uint8)
            self.w13_weight_scale = _zeros(EXPERTS, 2 * INTER, H // 32, dtype=torch.uint8)
            self.w2_weight_packed = _zeros(EXPERTS, H, INTER // 2, dtype=torch.uint8)
            self.w2_weight_scale = _zeros(EXPERTS, H, INTER // 32, dtype=torch.uint8)
            self.quant_method: FakeUnquantizedMethod = FakeFp4MoeMethod()
        else:
            self.w13_weight = _zeros(EXPERTS, 2 * INTER, H, dtype=torch.bfloat16)
            self.w2_weight = _zeros(EXPERTS, H, INTER, dtype=torch.bfloat16)
            self.quant_method = FakeUnquantizedMethod()

    def load_experts(self, named: list[tuple[int, str, str, torch.Tensor]]) -> None:
        if self.fmt == "MXFP4" and len(named) != EXPERTS * 3 * 2:
            raise RuntimeError(f"FP4 MoE loader needs all {EXPERTS * 6} expert tensors of a layer in one call, "
                               f"got {len(named)}")
        for e, proj, local, t in named:
            suffix = "" if local == "weight" else local.removeprefix("weight")
            if proj == "down_proj":
                getattr(self, f"w2_weight{suffix}").data[e].copy_(t)
            else:
                half = 0 if proj == "gate_proj" else 1
                getattr(self, f"w13_weight{suffix}").data[e, half * INTER:(half + 1) * INTER].copy_(t)


class FakeSglangModel(nn.Module):
    def __init__(self, linear: str | None = "MXFP8", moe: str | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, H, dtype=torch.bfloat16)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList()
        for _ in range(LAYERS):
            layer = nn.Module()
            layer.qkv_proj = FakeLinear(3, H, linear)
            layer.o_proj = FakeLinear(1, H, linear)
            layer.gate = FakeLinear(1, H, None)  # router: always BF16
            layer.gate.weight = _zeros(EXPERTS, H, dtype=torch.bfloat16)
            layer.experts = FakeFusedMoE(moe)
            self.layers.append(layer)
        self.lm_head = FakeLinear(1, H, None)
        self.lm_head.weight = _zeros(VOCAB, H, dtype=torch.bfloat16)
        self.rotary_emb = nn.Module()
        self.rotary_emb.register_buffer("cos_sin_cache", torch.randn(ROTARY_POSITIONS, H // 4))
        self.vision_tower = nn.Module()  # a patch embedding: no quant method, never post-processed
        self.vision_tower.patch_embed = _zeros(H, 3, 4, 4, dtype=torch.bfloat16)
        self.vision_tower.patch_embed.data.normal_()
        for m in self.modules():  # startup: kernel layouts
            if isinstance(getattr(m, "quant_method", None), FakeUnquantizedMethod):
                m.quant_method.process_weights_after_loading(m)
                m.quant_method.calls = 0
        self.calls: list[list[str]] = []  # names of every load_weights call

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.calls.append([n for n, _ in weights])
        experts: dict[int, list[tuple[int, str, str, torch.Tensor]]] = {}
        for name, t in weights:
            parts = name.removeprefix("model.").split(".")
            if parts[0] in ("embed_tokens", "lm_head"):
                getattr(self, parts[0]).weight.data.copy_(t)
                continue
            layer = self.layers[int(parts[1])]
            if parts[2] == "input_layernorm":
                continue
            if parts[3] == "experts":
                experts.setdefault(int(parts[1]), []).append((int(parts[4]), parts[5], parts[6], t))
                continue
            proj, local = parts[3], parts[4]
            if proj == "gate":
                layer.gate.weight.data.copy_(t)
                continue
            module = layer.o_proj if proj == "o_proj" else layer.qkv_proj
            if not hasattr(module, local):
                raise KeyError(f"{name}: the model has no parameter {local!r} there")
            module.load_shard(local, t, "qkv".index(proj[0]) if proj != "o_proj" else 0)
        for i, named in experts.items():
            self.layers[i].experts.load_experts(named)

    def quant_methods(self) -> list[FakeUnquantizedMethod]:
        return [m.quant_method for m in self.modules() if isinstance(getattr(m, "quant_method", None),
                                                                       FakeUnquantizedMethod)]


class FakeSglangEngine:
    """SGLang's Engine weight-update surface, in process."""

    def __init__(self, model: FakeSglangModel, custom_weight_loaders: tuple[str, ...] | None = None) -> None:
        from adapters.sglang.staging import LOADER_PATH

        self.model = model
        self.custom_weight_loaders = custom_weight_loaders if custom_weight_loaders is not None else (LOADER_PATH,)
        self.session = False
        self.flushes = 0
        self.loras: dict[str, dict[str, torch.Tensor]] = {}  # LoRA adapters held, by name
        self.lora_configs: dict[str, dict[str, object]] = {}
        self.fail_next_lora_load: str | None = None  # the message of the next load that fails

    # SGLang's LoRA calls (sglang.srt.entrypoints.engine.Engine), by the names and parameters the
    # adapter manifest (adapters/sglang/api.py) checks against the pinned release
    def load_lora_adapter_from_tensors(self, lora_name: str, tensors: dict[str, torch.Tensor],
                                       config_dict: dict[str, object], load_format: str | None = None) -> tuple[bool, str]:
        if lora_name in self.loras:
            return False, f"LoRA adapter {lora_name!r} is already loaded"
        if not {"r", "lora_alpha", "target_modules"} <= set(config_dict):
            return False, f"adapter_config lacks r, lora_alpha or target_modules: {sorted(config_dict)}"
        if self.fail_next_lora_load is not None:
            message, self.fail_next_lora_load = self.fail_next_lora_load, None
            return False, message
        self.loras[lora_name] = dict(tensors)
        self.lora_configs[lora_name] = dict(config_dict)
        return True, "Success"

    def unload_lora_adapter(self, lora_name: str) -> tuple[bool, str]:
        if self.loras.pop(lora_name, None) is None:
            return False, f"LoRA adapter {lora_name!r} is not loaded"
        return True, "Success"

    def flush_cache(self) -> tuple[bool, str]:
        self.flushes += 1
        return True, "Success"

    def begin_weight_update(self) -> tuple[bool, str]:
        if self.session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        for m in self.model.modules():
            qm = getattr(m, "quant_method", None)
            if qm is not None:
                qm.restore_weights_before_loading(m)
        self.session = True
        return True, "Success"

    def update_weights_from_tensor(self, named: list[tuple[str, torch.Tensor]], load_format: str | None,
                                   flush_cache: bool) -> tuple[bool, str]:
        if not self.session:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        if load_format in self.custom_weight_loaders:
            import importlib

            module, _, fn = load_format.rpartition(".")
            getattr(importlib.import_module(module), fn)(self.model, named)
        elif load_format is None:
            self.model.load_weights(named)
        else:
            raise NotImplementedError(f"Unknown load_format={load_format}")
        self.flushes += bool(flush_cache)
        return True, "Success"

    def end_weight_update(self) -> tuple[bool, str]:
        if not self.session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        for m in self.model.modules():
            qm = getattr(m, "quant_method", None)
            if qm is not None:
                qm.process_weights_after_loading(m)
        self.session = False
        return True, "Success"

    def storage_fingerprint(self):  # type: ignore[no-untyped-def]
        from domain.refit.storage import StorageFingerprint

        return StorageFingerprint.of(self.live_weights())

    def live_weights(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters()) | dict(self.model.named_buffers())


def trainer_weights(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """BF16 trainer weights for the fake model, in layer order."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    named = [("model.embed_tokens.weight", w(VOCAB, H))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        named += [(p + "input_layernorm.weight", w(H))]
        named += [(p + f"self_attn.{x}_proj.weight", w(H, H)) for x in "qkvo"]
        named.append((p + "mlp.gate.weight", w(EXPERTS, H)))
        for e in range(EXPERTS):
            named += [(p + f"mlp.experts.{e}.gate_proj.weight", w(INTER, H)),
                      (p + f"mlp.experts.{e}.up_proj.weight", w(INTER, H)),
                      (p + f"mlp.experts.{e}.down_proj.weight", w(H, INTER))]
    named.append(("lm_head.weight", w(VOCAB, H)))
    return named


def plan_for(linear: str | None, moe: str | None, native_mxfp8: bool = False):  # type: ignore[no-untyped-def]
    from domain.quant.plan import QuantizationPlan

    return QuantizationPlan.from_presets(linear=linear, moe=moe,
                                         scale_name="weight_scale_inv" if native_mxfp8 else "weight_scale")


class FakeTrainer:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return trainer_weights(self.seed)

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0):  # type: ignore[no-untyped-def]
        raise NotImplementedError


# --- an SGLang-shaped model for any refit stream (the RolloutEngine contract suite) ------------


class FakeGenericRebindMethod(FakeUnquantizedMethod):
    """Post-processing that rebinds every parameter's `.data` (same values, new storage)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.calls += 1
        for p in layer.parameters(recurse=False):
            p.data = p.data.clone()


class StreamSglangModel(nn.Module):
    def __init__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        for name, t in named:
            *path, local = name.split(".")
            module: nn.Module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, nn.Module())
                module = getattr(module, part)
            module.register_parameter(local, _zeros(*t.shape, dtype=t.dtype))
            module.quant_method = FakeGenericRebindMethod()

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t)


def stream_engine(named: list[tuple[str, torch.Tensor]], plan, vocab_size: int):  # type: ignore[no-untyped-def]
    """An SglangRolloutEngine over StreamSglangModel, serving a uniform distribution."""
    import math

    from adapters.sglang.engine import SglangRolloutEngine
    from domain.refit.engine_layout import layout_of

    def uniform(input_ids: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (input_ids.shape[0], input_ids.shape[1] - 1)
        return torch.full(shape, -math.log(vocab_size)), torch.full(shape, math.log(vocab_size))

    return SglangRolloutEngine(FakeSglangEngine(StreamSglangModel(named)), plan, log_prob_fn=uniform,
                               expected_layout=layout_of(named))
