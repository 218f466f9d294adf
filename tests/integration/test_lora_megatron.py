"""The Megatron LoRA wrapper: its adapter in Hugging Face names equals the one it was given, and its
forward adds exactly PEFT's delta (the domain's `delta_weight`) to each slice's rows."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from domain.lora import LoraAdapter, LoraUnknownTarget, LoraWeights, delta_weight
from tests.megatron_cpu import megatron_cpu_env, tiny_gpt_model  # noqa: F401

pytestmark = [pytest.mark.megatron, pytest.mark.usefixtures("megatron_cpu_env")]

HIDDEN, FFN, R = 32, 64, 4


def _hf_adapter(seed: int = 1) -> LoraAdapter:
    """A random adapter in PEFT's names for the tiny GPT (MHA, 4 heads of 8, gated MLP of 64)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (HIDDEN, HIDDEN),
              "self_attn.v_proj": (HIDDEN, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
              "mlp.gate_proj": (FFN, HIDDEN), "mlp.up_proj": (FFN, HIDDEN), "mlp.down_proj": (HIDDEN, FFN)}
    modules = {f"model.layers.{i}.{m}": LoraWeights(torch.randn(R, k, generator=g), torch.randn(n, R, generator=g))
               for i in range(2) for m, (n, k) in shapes.items()}
    targets = sorted({m.rsplit(".", 1)[1] for m in modules})
    return LoraAdapter(r=R, lora_alpha=8.0, target_modules=tuple(targets), modules=modules)


def _model() -> torch.nn.Module:
    return tiny_gpt_model(hidden_size=HIDDEN, ffn_hidden_size=FFN, gated_linear_unit=True,
                          activation_func=torch.nn.functional.silu, add_bias_linear=False)


def test_adapter_round_trips_through_the_wrapper_in_hf_names() -> None:
    from adapters.megatron.lora import MegatronLora

    want = _hf_adapter()
    lora = MegatronLora.attach(_model(), r=R, lora_alpha=8.0)
    lora.load(want)
    got = lora.adapter()
    assert sorted(got.modules) == sorted(want.modules)  # in Megatron's module order
    assert got.scaling == want.scaling
    for m, w in want.modules.items():
        assert torch.equal(got.modules[m].lora_A, w.lora_A), m
        assert torch.equal(got.modules[m].lora_B, w.lora_B), m


def test_forward_adds_each_slice_s_delta_to_its_rows() -> None:
    from adapters.megatron.hf_names import hf_parts
    from adapters.megatron.lora import MegatronLora

    model = _model()
    adapter = _hf_adapter(seed=2)
    lora = MegatronLora.attach(model, r=R, lora_alpha=8.0)
    lora.load(adapter)
    x = torch.randn(3, 2, HIDDEN)
    for name in ("decoder.layers.0.self_attention.linear_qkv", "decoder.layers.1.mlp.linear_fc1"):
        linear = model.get_submodule(name)
        with_lora, _ = linear(x)
        lora.detach()
        base, _ = linear(x)
        lora = MegatronLora.attach(model, r=R, lora_alpha=8.0)
        lora.load(adapter)
        fused_delta = torch.zeros_like(linear.weight)
        for hf, rows in hf_parts(model, f"{name}.weight", torch.arange(linear.weight.shape[0])):
            fused_delta[rows] = delta_weight(adapter.modules[hf.removesuffix(".weight")], adapter.scaling)
        torch.testing.assert_close(with_lora - base, x @ fused_delta.t(), rtol=1e-5, atol=1e-5)
        assert (with_lora - base).abs().max() > 1e-3  # the adapter did something


def test_model_state_dict_is_untouched_and_grads_reach_the_adapter() -> None:
    from adapters.megatron.lora import MegatronLora

    model = _model()
    names = list(model.state_dict())
    lora = MegatronLora.attach(model, r=R, lora_alpha=8.0, use_rslora=True)
    assert list(model.state_dict()) == names
    out, _ = model.get_submodule("decoder.layers.0.mlp.linear_fc2")(torch.randn(2, 1, FFN))
    out.sum().backward()
    branch = lora.branches["decoder.layers.0.mlp.linear_fc2"]
    assert branch.lora_B.grad is not None and branch.lora_B.grad.abs().sum() > 0


def test_loading_a_module_without_branch_is_refused() -> None:
    from adapters.megatron.lora import MegatronLora

    lora = MegatronLora.attach(_model(), r=R, lora_alpha=8.0, targets=("linear_qkv",))
    with pytest.raises(LoraUnknownTarget, match="has no LoRA branch") as info:
        lora.load(_hf_adapter())
    assert info.value.module == "model.layers.0.mlp.down_proj"  # the first one, in name order


def test_a_peft_adapter_passes_through_the_wrapper_unchanged() -> None:
    """A real PEFT adapter (a Qwen3 of the tiny GPT's shapes) loaded into the wrapper reads back equal."""
    transformers = pytest.importorskip("transformers", reason="needs transformers (the `hf` extra)")
    peft = pytest.importorskip("peft", reason="needs peft (the `hf` extra)")
    from adapters.hf.lora import adapter_from_peft
    from adapters.megatron.lora import MegatronLora

    config = transformers.AutoConfig.for_model(
        "qwen3", vocab_size=64, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=8)
    torch.manual_seed(3)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    pm = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(config),
                             peft.LoraConfig(r=R, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    want = adapter_from_peft(pm)
    lora = MegatronLora.attach(_model(), r=R, lora_alpha=8.0)
    lora.load(want)
    got = lora.adapter()
    assert sorted(got.modules) == sorted(want.modules) and len(got.modules) == 14
    assert got.target_modules == want.target_modules
    for m, w in want.modules.items():
        assert torch.equal(got.modules[m].lora_A, w.lora_A) and torch.equal(got.modules[m].lora_B, w.lora_B), m


def test_a_fresh_branch_leaves_the_model_unchanged_and_is_seeded() -> None:
    from adapters.megatron.lora import MegatronLora

    model = _model()
    linear = model.get_submodule("decoder.layers.0.self_attention.linear_qkv")
    x = torch.randn(2, 1, HIDDEN)
    base, _ = linear(x)
    first = MegatronLora.attach(model, r=R, lora_alpha=8.0, seed=5)
    with_lora, _ = linear(x)
    assert torch.equal(with_lora, base)  # lora_B starts at zero, as in PEFT
    first.detach()
    again = MegatronLora.attach(model, r=R, lora_alpha=8.0, seed=5)
    name = "decoder.layers.0.self_attention.linear_qkv"
    assert torch.equal(first.branches[name].lora_A, again.branches[name].lora_A)
    assert first.branches[name].lora_A.abs().max() <= 1 / HIDDEN ** 0.5


QKV, PROJ = "decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.self_attention.linear_proj"


def _tp2_rank(rank: int) -> dict[str, Any]:
    """One rank of a tensor-parallel world of 2: its branches' tensors, gradients and deltas."""
    from megatron.core import parallel_state

    from adapters.megatron.cpu import megatron_on_cpu
    from adapters.megatron.lora import MegatronLora

    with megatron_on_cpu():
        parallel_state.initialize_model_parallel(2, 1)
        model = _model()
        lora = MegatronLora.attach(model, r=R, lora_alpha=8.0, seed=5)
        qkv, proj = lora.branches[QKV], lora.branches[PROJ]
        with torch.no_grad():  # each rank its own rows of B; the row-parallel B is replicated
            qkv.lora_B.copy_(torch.randn(qkv.lora_B.shape, generator=torch.Generator().manual_seed(100 + rank)))
            proj.lora_B.copy_(torch.randn(proj.lora_B.shape, generator=torch.Generator().manual_seed(9)))
        x = torch.randn(3, 2, HIDDEN, generator=torch.Generator().manual_seed(7))
        out, _ = model.get_submodule(QKV)(x)
        out.sum().backward()
        half = HIDDEN // 2
        x_local = x[..., rank * half:(rank + 1) * half]
        with_lora, _ = model.get_submodule(PROJ)(x_local)
        lora.detach()
        base, _ = model.get_submodule(PROJ)(x_local)
        assert qkv.lora_A.grad is not None
        out_ = {"qkv_A": qkv.lora_A.detach().flatten().tolist(), "qkv_A_grad": qkv.lora_A.grad.flatten().tolist(),
                "proj_A": proj.lora_A[0].detach().flatten().tolist(), "proj_B": proj.lora_B.detach().flatten().tolist(),
                "x": x.flatten().tolist(), "row_delta": (with_lora - base).detach().flatten().tolist(),
                "local_qkv_B_rows": qkv.lora_B.shape[0]}
        want = _hf_adapter()
        lora.load(want)
        got = lora.adapter()
        differ = [m for m, w in want.modules.items() if not (
            torch.equal(got.modules[m].lora_A, w.lora_A) and torch.equal(got.modules[m].lora_B, w.lora_B))]
        from adapters.megatron.hf_names import hf_parts

        fused = torch.zeros(3 * HIDDEN, HIDDEN)  # the whole linear_qkv's delta, in Megatron's row order
        for hf, rows in hf_parts(model, f"{QKV}.weight", torch.arange(3 * HIDDEN)):
            fused[rows] = delta_weight(want.modules[hf.removesuffix(".weight")], want.scaling)
        local = fused.chunk(2, dim=0)[rank]  # the rows ColumnParallelLinear gives this rank
        shard_error = (qkv(x) - x @ local.t()).abs().max().item()
        return {**out_, "round_trip": (sorted(got.modules) == sorted(want.modules), differ),
                "shard_error": shard_error}


def test_tensor_parallel_branches_reduce_what_they_must() -> None:
    """At TP=2: an adapter in Hugging Face names loads as shards and is gathered back unchanged; the replicated lora_A of a column-parallel branch is the same on both ranks and gets
    the whole gradient (all-reduced over the ranks' rows of lora_B); a row-parallel branch adds
    x @ (B @ A).T with A gathered over the ranks' columns."""
    from adapters.distributed.launch import launch_world

    results = launch_world(_tp2_rank, 2, timeout_s=240, start_method="forkserver")
    failed = [f"rank {r.rank}: {r.error}\n{r.traceback or ''}\n{r.output or ''}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    r0, r1 = (r.value for r in results)
    for r in (r0, r1):  # each rank holds half of the rows and reads the whole adapter back
        assert r["local_qkv_B_rows"] == 3 * HIDDEN // 2
        assert r["round_trip"] == (True, [])
        assert r["shard_error"] < 1e-4  # the loaded shard computes the rank's rows of the whole delta
    assert r0["qkv_A"] == r1["qkv_A"]
    assert r0["qkv_A_grad"] == r1["qkv_A_grad"] and any(g != 0 for g in r0["qkv_A_grad"])
    a_full = torch.cat([torch.tensor(r["proj_A"]).reshape(R, HIDDEN // 2) for r in (r0, r1)], dim=1)
    b = torch.tensor(r0["proj_B"]).reshape(HIDDEN, R)
    want = torch.tensor(r0["x"]).reshape(3, 2, HIDDEN) @ (b @ a_full).t() * 2.0
    for r in (r0, r1):
        torch.testing.assert_close(torch.tensor(r["row_delta"]).reshape(3, 2, HIDDEN), want, rtol=1e-5, atol=1e-5)
