"""A CPU fake of the vLLM objects a refit touches, shaped like vLLM 0.33's.

- `FakeVllmModel.load_weights(weights)` maps checkpoint names onto fused parameters
  (q/k/v -> `qkv_proj`, gate/up -> `gate_up_proj`) and calls each parameter's `weight_loader`.
- Linear layers carry a `quant_method` whose `process_weights_after_loading` *replaces* its
  parameters (new objects, a column-major scale), as vLLM's FP8 methods do.
- Attention layers carry `_q/_k/_v/_prob_scale` (buffers, or grad-requiring Parameters), left at
  a dummy-load value, and a KV-cache quant method whose config may have a `kv_cache_scheme`.
- `FakeLayerwise` reproduces vLLM's layerwise reload: `initialize` keeps the kernel tensors and
  swaps in checkpoint-format parameters whose loaders buffer the loaded tensors *by reference*;
  a layer is processed as soon as all its elements are in, attention layers at `finalize`, and
  the results are copied into the kept kernel tensors (or, with `copy_back=False`, left rebound,
  the bug the storage check must catch).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from adapters.vllm.hooks import VllmHooks

H, INTER, VOCAB, LAYERS = 128, 256, 64, 2
DUMMY_KV = 0.37  # what a dummy load leaves in the KV-cache scales


class FakeQuantConfig:
    def __init__(self, kv_cache_scheme: dict | None = None) -> None:
        self.kv_cache_scheme = kv_cache_scheme


class FakeUnquantizedLinearMethod:
    def __init__(self) -> None:
        self.calls = 0

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.calls += 1


class FakeFp8BlockLinearMethod:
    """Replaces both parameters; the scale becomes column-major (what DeepGEMM wants)."""

    def __init__(self) -> None:
        self.calls = 0

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.calls += 1
        layer.weight = nn.Parameter(layer.weight.data.clone(), requires_grad=False)
        layer.weight_scale = nn.Parameter(layer.weight_scale.data.t().contiguous().t(), requires_grad=False)


class FakeBaseKVCacheMethod:
    def __init__(self, quant_config: FakeQuantConfig) -> None:
        self.quant_config = quant_config
        self.calls = 0

    def create_weights(self, layer: nn.Module) -> None:
        for n in ("q_scale", "k_scale", "v_scale", "prob_scale"):
            setattr(layer, n, nn.Parameter(torch.tensor(-1.0)))  # grad-requiring sentinels

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.calls += 1
        with torch.no_grad():
            for n in ("q_scale", "k_scale", "v_scale", "prob_scale"):
                value = getattr(layer, n)
                if float(value) > 0:
                    getattr(layer, "_" + n).copy_(value)
                delattr(layer, n)


def _loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
    rows = param.shard_rows  # type: ignore[attr-defined]
    start = sum(rows[:shard_id]) if shard_id is not None else 0
    n = loaded.shape[0]
    param.data[start : start + n].copy_(loaded)


def _param(shape: tuple[int, ...], dtype: torch.dtype, shard_rows: list[int]) -> nn.Parameter:
    p = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
    p.weight_loader = _loader  # type: ignore[attr-defined]
    p.shard_rows = shard_rows  # type: ignore[attr-defined]
    return p


class FakePackedHeadMethod:
    """vLLM's UnquantizedEmbeddingMethod on CPU: processing packs a copy of the weight outside the
    parameters (`dispatch_cpu_unquantized_gemm`'s `cpu_linear`), and serving reads that copy."""

    def __init__(self) -> None:
        self.calls = 0

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.calls += 1
        layer.packed = layer.weight.detach().clone()


class FakeLinear(nn.Module):
    def __init__(self, shards: list[int], k: int, quantized: bool) -> None:
        super().__init__()
        n = sum(shards)
        if quantized:
            self.weight = _param((n, k), torch.float8_e4m3fn, shards)
            self.weight_scale = _param((math.ceil(n / 128), math.ceil(k / 128)), torch.float32,
                                       [math.ceil(s / 128) for s in shards])
            self.quant_method: object = FakeFp8BlockLinearMethod()
        else:
            self.weight = _param((n, k), torch.bfloat16, shards)
            self.quant_method = FakeUnquantizedLinearMethod()


class FakeAttention(nn.Module):
    """vLLM's Attention: scales registered at init, at a dummy-load value."""

    def __init__(self, quant_config: FakeQuantConfig | None, scales_as_parameters: bool = False) -> None:
        super().__init__()
        for n in ("_q_scale", "_k_scale", "_v_scale", "_prob_scale"):
            value = torch.tensor(DUMMY_KV)
            if scales_as_parameters:
                setattr(self, n, nn.Parameter(value))  # requires grad: fill_ needs no_grad
            else:
                self.register_buffer(n, value)
        self._k_scale_float = self._v_scale_float = self._q_scale_float = DUMMY_KV
        self.quant_method = FakeBaseKVCacheMethod(quant_config) if quant_config is not None else None
        if self.quant_method is not None:
            self.quant_method.create_weights(self)
            self.quant_method.process_weights_after_loading(self)
            with torch.no_grad():  # what a dummy load does to every tensor
                for n in ("_q_scale", "_k_scale", "_v_scale", "_prob_scale"):
                    getattr(self, n).fill_(DUMMY_KV)
            self.quant_method.calls = 0

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        if self.quant_method is None:
            set_default_quant_scales(self)


def set_default_quant_scales(layer: nn.Module, register_buffer: bool = False) -> None:
    """vLLM's helper (attention.py), reproduced: fill the scales in place, host copies to 1.0."""
    layer._k_scale.fill_(1.0)
    layer._v_scale.fill_(1.0)
    layer._q_scale.fill_(1.0)
    layer._prob_scale.fill_(1.0)
    layer._q_scale_float = layer._k_scale_float = layer._v_scale_float = 1.0


class FakeVllmModel(nn.Module):
    """A two-layer decoder as vLLM builds it (fused qkv and gate/up)."""

    stacked: ClassVar[dict[str, tuple[str, int]]] = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, quantized: bool = True, kv_cache_scheme: dict | None = None,
                 scales_as_parameters: bool = False, tied: bool = False) -> None:
        super().__init__()
        qc = FakeQuantConfig(kv_cache_scheme) if quantized else None
        self.tied = tied
        self.embed_tokens = nn.Embedding(VOCAB, H, dtype=torch.bfloat16)
        self.embed_tokens.weight.requires_grad_(False)
        if tied:  # vLLM's VocabParallelEmbedding: a parameter with a weight_loader
            self.embed_tokens.weight = _param((VOCAB, H), torch.bfloat16, [VOCAB])
        self.layers = nn.ModuleList()
        for _ in range(LAYERS):
            layer = nn.Module()
            layer.self_attn = nn.Module()
            layer.self_attn.qkv_proj = FakeLinear([H, H, H], H, quantized)
            layer.self_attn.o_proj = FakeLinear([H], H, quantized)
            layer.self_attn.attn = FakeAttention(qc, scales_as_parameters)
            layer.mlp = nn.Module()
            layer.mlp.gate_up_proj = FakeLinear([INTER, INTER], H, quantized)
            layer.mlp.down_proj = FakeLinear([H], INTER, quantized)
            layer.input_layernorm = nn.Module()
            layer.input_layernorm.weight = _param((H,), torch.bfloat16, [H])
            self.layers.append(layer)
        self.lm_head = nn.Module()
        # tied (vLLM's `lm_head.tie_weights(embed_tokens)`): one Parameter under two names
        self.lm_head.weight = self.embed_tokens.weight if tied else _param((VOCAB, H), torch.bfloat16, [VOCAB])
        if tied:
            self.lm_head.quant_method = FakePackedHeadMethod()
        self.names_loaded: list[str] = []
        self.load_calls = 0
        self.fail_at_call: int | None = None
        # vLLM's record_metadata_for_reloading: checkpoint-format parameters, before processing
        self.ckpt_meta = {m: {n: (tuple(p.shape), p.dtype, p.weight_loader, p.shard_rows)
                              for n, p in m.named_parameters(recurse=False, remove_duplicate=False)
                              if hasattr(p, "weight_loader")}
                          for m in self.modules()}
        for m in self.modules():  # the engine's first load: kernel layout
            qm = getattr(m, "quant_method", None)
            if isinstance(qm, (FakeFp8BlockLinearMethod, FakeUnquantizedLinearMethod, FakePackedHeadMethod)):
                qm.process_weights_after_loading(m)
                qm.calls = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self.load_calls += 1
        if self.fail_at_call == self.load_calls - 1:
            raise RuntimeError(f"injected failure in load_weights call {self.load_calls - 1}")
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded = set()
        for name, tensor in weights:
            self.names_loaded.append(name)
            target, shard = name.removeprefix("model."), None
            if self.tied and target.startswith("lm_head."):
                continue  # vLLM's AutoWeightsLoader(skip_prefixes=["lm_head."]) of a tied model
            if target == "embed_tokens.weight" and not self.tied:
                with torch.no_grad():
                    self.embed_tokens.weight.copy_(tensor)
                loaded.add(target)
                continue
            for proj, (fused, sid) in self.stacked.items():
                if f".{proj}." in target:
                    target, shard = target.replace(f".{proj}.", f".{fused}."), sid
                    break
            if target not in params:
                raise KeyError(f"{name} has no parameter in the model")
            p = params[target]
            p.weight_loader(p, tensor, shard)
            loaded.add(target)
        return loaded

    def quant_methods(self) -> list[object]:
        return [m.quant_method for m in self.modules() if getattr(m, "quant_method", None) is not None]


class FakeLayerwise:
    """vLLM's layerwise reload (model_loader/reload/layerwise.py), reproduced on CPU."""

    def __init__(self, copy_back: bool = True) -> None:
        self.copy_back = copy_back
        self.info: dict[nn.Module, dict] = {}
        self.initialized = 0
        self.finalized = 0

    def initialize(self, model: FakeVllmModel) -> None:
        self.initialized += 1
        for m in model.modules():
            meta = model.ckpt_meta.get(m) or {}
            if not meta:
                continue
            kernel = dict(m.named_parameters(recurse=False, remove_duplicate=False))
            info = {"kernel": kernel, "meta": meta, "loaded": [], "numel": 0,
                    "total": sum(math.prod(s) for s, *_ in meta.values()), "done": False}
            self.info[m] = info
            for name, (shape, dtype, _loader, rows) in meta.items():
                p = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)
                p.weight_loader = self._deferred(m, name)  # type: ignore[attr-defined]
                p.shard_rows = rows  # type: ignore[attr-defined]
                setattr(m, name, p)

    def _deferred(self, layer: nn.Module, name: str):  # type: ignore[no-untyped-def]
        def loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: int | None = None) -> None:
            info = self.info[layer]
            info["loaded"].append((name, loaded, shard_id))  # by reference, as vLLM does
            info["numel"] += loaded.numel()
            if info["numel"] >= info["total"]:
                self._process(layer, info)
        return loader

    def _process(self, layer: nn.Module, info: dict) -> None:
        for name, (shape, dtype, loader, rows) in info["meta"].items():
            p = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            p.weight_loader, p.shard_rows = loader, rows  # type: ignore[attr-defined]
            setattr(layer, name, p)
        for name, loaded, shard in info["loaded"]:
            param = getattr(layer, name)
            param.weight_loader(param, loaded, shard)
        qm = getattr(layer, "quant_method", None)
        if qm is not None:
            qm.process_weights_after_loading(layer)
        if self.copy_back:
            for name, kernel in info["kernel"].items():
                kernel.data.copy_(getattr(layer, name))
                setattr(layer, name, kernel)
        info["done"] = True

    def finalize(self, model: FakeVllmModel, model_config: object) -> None:
        self.finalized += 1
        for m, info in list(self.info.items()):
            if not info["done"]:
                if info["numel"] == 0:
                    for name, kernel in info["kernel"].items():
                        setattr(m, name, kernel)
                else:  # partially loaded: processed anyway (vLLM's "delayed processing")
                    self._process(m, info)
        self.info.clear()
        for m in model.modules():
            if isinstance(m, FakeAttention):
                m.process_weights_after_loading(torch.bfloat16)


def fake_hooks(layerwise: FakeLayerwise) -> VllmHooks:
    return VllmHooks(
        initialize_reload=layerwise.initialize,  # type: ignore[arg-type]
        finalize_reload=layerwise.finalize,  # type: ignore[arg-type]
        is_kv_cache_method=lambda qm: isinstance(qm, FakeBaseKVCacheMethod),
        set_default_kv_scales=set_default_quant_scales,
    )


def fake_greedy(model: FakeVllmModel):  # type: ignore[no-untyped-def]
    """Greedy tokens for the fake: each next token is the argmax of embed(last token) @ lm_head^T."""

    def greedy(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        head = getattr(model.lm_head, "packed", model.lm_head.weight).float()
        out = []
        for prompt in prompts:
            tokens, last = [], prompt[-1]
            for _ in range(max_tokens):
                last = int((model.embed_tokens.weight[last].float() @ head.t()).argmax())
                tokens.append(last)
            out.append(tokens)
        return out

    return greedy


def fake_log_probs(model: FakeVllmModel):  # type: ignore[no-untyped-def]
    """Serving for the fake: log-softmax of embed(ids) @ lm_head^T."""

    def log_probs(input_ids: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = model.embed_tokens.weight[input_ids[:, :-1]].float()
        head = getattr(model.lm_head, "packed", model.lm_head.weight)  # a tied head serves its packed copy
        logits = hidden @ head.float().t() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        return logp.gather(-1, input_ids[:, 1:, None])[..., 0], -(logp.exp() * logp).sum(-1)

    return log_probs


def trainer_weights(seed: int = 0, tied: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The trainer's BF16 weights for the fake model, in layer order (Hugging Face names; a tied
    model has no `lm_head.weight`, as transformers writes it)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    named = [("model.embed_tokens.weight", w(VOCAB, H))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        named += [(p + "input_layernorm.weight", w(H)),
                  (p + "self_attn.q_proj.weight", w(H, H)), (p + "self_attn.k_proj.weight", w(H, H)),
                  (p + "self_attn.v_proj.weight", w(H, H)), (p + "self_attn.o_proj.weight", w(H, H)),
                  (p + "mlp.gate_proj.weight", w(INTER, H)), (p + "mlp.up_proj.weight", w(INTER, H)),
                  (p + "mlp.down_proj.weight", w(H, INTER))]
    if not tied:
        named.append(("lm_head.weight", w(VOCAB, H)))
    return named


def fp8_plan(quantized: bool = True):  # type: ignore[no-untyped-def]
    from domain.quant.plan import QuantizationPlan

    return QuantizationPlan.from_presets(linear="FP8_BLOCK" if quantized else None)


def checkpoint_stream(quantized: bool, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """The refit stream for the fake model: FP8_BLOCK through the real codecs, or BF16."""
    from domain.quant.stream import quantize_stream

    return list(quantize_stream(fp8_plan(quantized), trainer_weights(seed)))


class FakeTrainer:
    """A TrainerModel over `trainer_weights(seed)` (the seed changes per refit when asked)."""

    def __init__(self, seed: int = 0, tied: bool = False) -> None:
        self.seed = seed
        self.tied = tied

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return trainer_weights(self.seed, self.tied)

    def log_probs(self, input_ids: torch.Tensor, *, temperature: float = 1.0):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.named_weights())


# --- a vLLM-shaped model for any refit stream (the RolloutEngine contract suite) ---------------


class FakeGenericMethod:
    """A quant method that replaces every parameter of its layer (new objects, same values)."""

    def __init__(self) -> None:
        self.calls = 0

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.calls += 1
        for name, p in list(layer.named_parameters(recurse=False)):
            setattr(layer, name, nn.Parameter(p.data.clone(), requires_grad=False))


class StreamVllmModel(nn.Module):
    """One module per checkpoint module of a stream, one parameter per checkpoint tensor."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        for name, t in named:
            *path, local = name.split(".")
            module: nn.Module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, nn.Module())
                module = getattr(module, part)
            module.register_parameter(local, _param(tuple(t.shape), t.dtype, [t.shape[0] if t.dim() else 1]))
            module.quant_method = FakeGenericMethod()
        self.ckpt_meta = {m: {n: (tuple(p.shape), p.dtype, p.weight_loader, p.shard_rows)
                              for n, p in m.named_parameters(recurse=False)} for m in self.modules()}
        for m in self.modules():
            if isinstance(getattr(m, "quant_method", None), FakeGenericMethod):
                m.quant_method.process_weights_after_loading(m)
                m.quant_method.calls = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            p = params[name]  # a KeyError for an unknown name, as vLLM's loaders raise
            p.weight_loader(p, tensor.reshape(p.shape) if tensor.dim() == 0 else tensor)
            loaded.add(name)
        return loaded  # the parameters written, as vLLM's load_weights returns them


def stream_engine(named: list[tuple[str, torch.Tensor]], vocab_size: int):  # type: ignore[no-untyped-def]
    """A VllmRolloutEngine over StreamVllmModel, serving a uniform distribution."""
    from adapters.vllm.engine import VllmRolloutEngine
    from domain.refit.engine_layout import layout_of

    model = StreamVllmModel(named)
    layerwise = FakeLayerwise()

    def uniform(input_ids: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (input_ids.shape[0], input_ids.shape[1] - 1)
        return torch.full(shape, -math.log(vocab_size)), torch.full(shape, math.log(vocab_size))

    def first_token(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return [[0] * max_tokens for _ in prompts]  # the first token of a uniform distribution

    return VllmRolloutEngine.in_process(model, None, fake_hooks(layerwise), log_prob_fn=uniform,
                                        greedy_fn=first_token, expected_layout=layout_of(named))


# --- vLLM's worker with rl-refit's extension mixed in, and an LLM whose collective_rpc reaches it ---


def msgpack_like(value: object) -> object:
    """What crossing vLLM's msgpack does to a plain value: tuples become lists, dict keys stay
    strings, bytes stay bytes; anything that is not a plain value is refused (a tensor would lose
    its data)."""
    if isinstance(value, dict):
        assert all(isinstance(k, str) for k in value), f"msgpack keys must be strings: {list(value)}"
        return {k: msgpack_like(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [msgpack_like(v) for v in value]
    assert value is None or isinstance(value, bool | int | float | str | bytes), f"not a plain value: {type(value)}"
    return value


def fake_worker_class(extension: type) -> type:
    """vLLM's worker class with `extension` mixed in (what `worker_extension_cls` does), over a
    fake model and fake layerwise reload instead of vLLM's."""

    class FakeWorker(extension):  # type: ignore[misc,valid-type]
        def __init__(self, model: nn.Module, layerwise: FakeLayerwise, rank: int = 0) -> None:
            self.model = model
            self.layerwise = layerwise
            self.rank = rank

        def _rl_refit_state(self):  # type: ignore[no-untyped-def]
            from adapters.vllm.worker import WorkerRefit

            if getattr(self, "_rl_refit", None) is None:
                self._rl_refit = WorkerRefit(self.model, None, fake_hooks(self.layerwise))
            return self._rl_refit

        def _rl_refit_context(self):  # type: ignore[no-untyped-def]
            import contextlib

            return contextlib.nullcontext()  # vLLM's set_current_vllm_config

    return FakeWorker


class FakeLlm:
    """`vllm.LLM` as the adapter's clients use it: `collective_rpc(method, args)` runs the method on
    every worker and returns each one's answer. `plain=True` crosses arguments and answers as
    vLLM's multiprocess engine does (msgpack); `plain=False` passes them by reference (the
    colocated engine, `VLLM_ENABLE_V1_MULTIPROCESSING=0`)."""

    def __init__(self, workers: list[object], plain: bool = False) -> None:
        self.workers = workers
        self.plain = plain
        self.calls: list[str] = []
        self.shut = False

    def collective_rpc(self, method: str, args: tuple[object, ...] = ()) -> list[object]:
        self.calls.append(method)
        if self.plain:
            args = tuple(msgpack_like(a) for a in args)
        answers = [getattr(w, method)(*args) for w in self.workers]
        return [msgpack_like(a) for a in answers] if self.plain else answers


def extension_engine(quantized: bool = True, workers: int = 1, extension: type | None = None):  # type: ignore[no-untyped-def]
    """A VllmRolloutEngine over ExtensionWorkers over a FakeLlm whose workers are fake vLLM workers
    with rl-refit's extension (`extension`, default RefitWorkerExtension); returns (models, llm,
    engine)."""
    from adapters.vllm.client import ExtensionWorkers
    from adapters.vllm.engine import VllmRolloutEngine
    from adapters.vllm.extension import RefitWorkerExtension

    cls = fake_worker_class(extension or RefitWorkerExtension)
    models = [FakeVllmModel(quantized) for _ in range(workers)]
    llm = FakeLlm([cls(m, FakeLayerwise(), rank) for rank, m in enumerate(models)])
    return models, llm, VllmRolloutEngine(ExtensionWorkers(llm), log_prob_fn=fake_log_probs(models[0]),
                                          greedy_fn=fake_greedy(models[0]))
