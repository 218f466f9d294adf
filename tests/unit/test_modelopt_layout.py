"""domain.quant.modelopt_layout: NVFP4 experts in ModelOpt's checkpoint layout (the names, the
decode scale, the config vLLM reads). Against vLLM's own quantizer: tests/vllm/test_modelopt_nvfp4.py."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch

from domain.quant import modelopt_layout as mo
from domain.quant.codecs import nvfp4_global_scale, quantize_weight
from domain.quant.formats import NVFP4
from domain.quant.plan import QuantizationPlan


def test_tensors_keep_the_codes_and_store_the_decode_scale() -> None:
    w = torch.randn(32, 64).to(torch.bfloat16)
    ct = quantize_weight(NVFP4, w, global_scale=nvfp4_global_scale(w)).tensors
    out = mo.modelopt_tensors(ct)
    assert set(out) == {"weight", "weight_scale", "weight_scale_2"}
    assert out["weight"] is ct["weight_packed"] and out["weight_scale"] is ct["weight_scale"]
    assert out["weight_scale_2"].shape == () and out["weight_scale_2"].dtype == torch.float32
    # python_float / tensor is tensor.reciprocal() * python_float, as vLLM writes it
    assert torch.equal(out["weight_scale_2"], ct["weight_global_scale"].reshape(()).reciprocal())


def test_a_projection_without_its_global_scale_is_refused() -> None:
    with pytest.raises(KeyError, match="weight_global_scale"):
        mo.modelopt_tensors({"weight_packed": torch.zeros(1), "weight_scale": torch.zeros(1)})


def test_names() -> None:
    assert mo.rename("model.layers.1.mlp.experts.3.up_proj.weight_packed") == "model.layers.1.mlp.experts.3.up_proj.weight"
    assert mo.rename("model.layers.1.mlp.experts.3.up_proj.weight_global_scale") == (
        "model.layers.1.mlp.experts.3.up_proj.weight_scale_2")
    assert mo.rename("model.layers.1.mlp.experts.3.up_proj.weight_scale") == "model.layers.1.mlp.experts.3.up_proj.weight_scale"
    assert mo.rename("model.norm.weight") == "model.norm.weight"


def test_config_is_modelopts_nvfp4_with_the_bf16_modules_excluded() -> None:
    qc = mo.quantization_config(["lm_head", "model.layers.0.self_attn.q_proj", "lm_head"])
    assert qc == {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                  "ignore": ["lm_head", "model.layers.0.self_attn.q_proj"], "kv_cache_scheme": None}
    # a fused module whose members are all kept is listed by its own name too
    p = "model.layers.0"
    kept = [f"{p}.self_attn.{x}_proj" for x in "qkv"] + [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj", f"{p}.mlp.down_proj"]
    ignore = mo.quantization_config(kept)["ignore"]
    assert f"{p}.self_attn.qkv_proj" in ignore and f"{p}.mlp.gate_up_proj" in ignore
    assert mo.with_fused_names([f"{p}.mlp.gate_proj"]) == [f"{p}.mlp.gate_proj"]  # up_proj is quantized
    assert mo.PER_TOKEN_OVERRIDE == {"moe": {"activation": "nvfp4_per_token"}}


def _moe(layers: int = 2, experts: int = 2) -> list[tuple[str, torch.Tensor]]:
    out = [("model.embed_tokens.weight", torch.randn(128, 64))]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [(f"{p}.self_attn.q_proj.weight", torch.randn(64, 64)), (f"{p}.mlp.gate.weight", torch.randn(experts, 64))]
        out += [(f"{p}.mlp.experts.{e}.{n}_proj.weight", torch.randn(*s) * (e + 1)) for e in range(experts)
                for n, s in (("gate", (32, 64)), ("up", (32, 64)), ("down", (64, 32)))]
    return [*out, ("lm_head.weight", torch.randn(128, 64))]


def test_the_stream_writes_vllms_per_token_nvfp4_experts_in_modelopts_layout() -> None:
    from adapters.engine_quantization import NUMERICS_KEY, engine_quantization_config
    from app.services.planning import bf16_linear_modules
    from domain.quant.stream import checkpoint_specs, quantize_stream
    from tests.dispatching import DispatchInput, resolve

    model = _moe()
    ignore = ("re:.*layers\\.0\\..*",)  # the first layer BF16, as with first_last_layers_bf16
    res = resolve(DispatchInput(engine="vllm", requested=QuantizationPlan.from_presets(moe="NVFP4", ignore=ignore)))
    plan = res.plan
    out = dict(quantize_stream(plan, model))
    ct = dict(quantize_stream(attrs.evolve(plan, expert_layout="compressed-tensors"), model))
    e1 = "model.layers.1.mlp.experts.1"
    for proj in ("gate_proj", "up_proj", "down_proj"):
        m = f"{e1}.{proj}"
        assert torch.equal(out[f"{m}.weight"], ct[f"{m}.weight_packed"])
        assert torch.equal(out[f"{m}.weight_scale"].view(torch.uint8), ct[f"{m}.weight_scale"].view(torch.uint8))
        assert torch.equal(out[f"{m}.weight_scale_2"], (1.0 / ct[f"{m}.weight_global_scale"]).reshape(()))
    assert torch.equal(out[f"{e1}.gate_proj.weight_scale_2"], out[f"{e1}.up_proj.weight_scale_2"])
    assert out["model.layers.0.mlp.experts.0.gate_proj.weight"].dtype == torch.float32  # ignored: BF16 source as is
    assert out["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float32  # Linear layers unquantized
    # the names and shapes are known before anything is computed
    specs = [sp for n, t in model for sp in checkpoint_specs(plan, n, tuple(t.shape), t.dtype)]
    assert [(sp.name, sp.shape, sp.dtype) for sp in specs] == [(n, tuple(t.shape), t.dtype) for n, t in out.items()]
    # the config: ModelOpt NVFP4, every BF16 Linear and the BF16 experts layer excluded
    kept = bf16_linear_modules(plan, [(n, tuple(t.shape)) for n, t in model])
    qc = engine_quantization_config(res, kept)
    assert qc is not None and qc.pop(NUMERICS_KEY)
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4"
    assert {"model.layers.0.mlp.experts", "model.layers.1.self_attn.q_proj", "lm_head"} <= set(qc["ignore"])
    assert not any(i.startswith("model.layers.1.mlp.experts") for i in qc["ignore"])


def test_vllm_starts_modelopt_checkpoints_with_the_per_token_expert_override() -> None:
    from adapters.vllm.factory import vllm_engine_kwargs
    from adapters.vllm.profile import BACKEND_POLICY
    from domain.quant.backend_policy import decide_backends

    plan = QuantizationPlan.from_presets(moe="NVFP4")
    decision = decide_backends(BACKEND_POLICY, plan, (10, 0), layout=mo.LAYOUT)
    kwargs = vllm_engine_kwargs(mo.quantization_config(["lm_head"]), decision)
    assert kwargs["quantization"] == "modelopt"
    assert kwargs["quantization_config"] == {"moe": {"activation": "nvfp4_per_token"}}
    assert kwargs["hf_overrides"]["quantization_config"]["quant_algo"] == "NVFP4"
    assert "TRT-LLM" in decision.moe.reason and decision.moe.backend == "auto"
    ct = vllm_engine_kwargs({"quant_method": "compressed-tensors"}, decision)
    assert "quantization_config" not in ct


def test_sharded_exports_name_modelopt_experts_as_the_stream_does() -> None:
    from domain.quant.stream import quantize_stream
    from domain.refit.shard_quant import checkpoint_items, quantize_shard

    plan = QuantizationPlan(moe=NVFP4, expert_layout="modelopt")
    name = "model.layers.1.mlp.experts.0.down_proj.weight"
    w = torch.randn(64, 32)
    d = plan.decide(name, (64, 32))
    gs = nvfp4_global_scale(w)
    items = checkpoint_items(plan, d, quantize_shard(plan, d, w, gs))
    want = list(quantize_stream(plan, [(name, w)]))
    assert [n for n, _ in items] == [n for n, _ in want]
    for (_, a), (_, b) in zip(items, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_qat_nvfp4_with_nvfp4_experts_plans_as_served_on_vllm(capsys: pytest.CaptureFixture) -> None:
    import json

    from app.cli.main import main

    assert main(["plan", "--json", "rollout.name=vllm", "rollout.quantization.moe=NVFP4",
                 "actor.megatron.qat.enable=true", "actor.megatron.qat.mode=nvfp4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plan"]["layout"] == "modelopt-nvfp4" and report["plan"]["moe_activation"] == "nvfp4_per_token"
    assert report["engine_config"]["quant_method"] == "modelopt"


NATIVE_NVFP4 = """\
rollout:
  name: vllm
  quantization:
    moe: NVFP4
    moe_activation: nvfp4_per_token
    ignore: {ignore}
actor:
  megatron:
    qat:
      enable: true
      mode: nvfp4
    override_transformer_config:
      first_last_layers_bf16: true
"""


@pytest.mark.parametrize("ignore", ['["re:.*layers\\\\.(0|3)\\\\..*"]', "[]"])
def test_the_native_nvfp4_example_plans_as_served_on_vllm(ignore: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    """The seed's native-NVFP4 example: per-token NVFP4 experts, QAT nvfp4 keeping the first and
    last layers BF16 (first_last_layers_bf16), and an ignore list that keeps the same layers BF16 in
    the rollout: served, in ModelOpt's layout. Without the ignore list, FirstLastLayersBf16 refuses it."""
    import json

    from adapters.reference.config import TINY_MOE
    from adapters.reference.hf import write_checkpoint
    from adapters.reference.trainer import ReferenceTrainer
    from app.cli.main import main

    model = write_checkpoint(TINY_MOE, ReferenceTrainer.from_seed(TINY_MOE, 0).named_weights(), tmp_path / "model")
    config = tmp_path / "native-nvfp4.yaml"
    config.write_text(NATIVE_NVFP4.format(ignore=ignore))
    code = main(["plan", str(config), "--model", str(model), "--json"])
    out = json.loads(capsys.readouterr().out)
    if ignore == "[]":  # layers 0 and 3 train BF16 but the rollout would quantize layer 3's experts
        assert code == 2 and out["error"]["type"] == "BoundaryLayersMismatch"
        assert "rollout quantizes layers [3]" in out["error"]["message"]
        return
    assert code == 0, out
    assert out["checked"] == "engine vllm"
    assert out["plan"]["layout"] == "modelopt-nvfp4" and out["plan"]["moe_activation"] == "nvfp4_per_token"
    boundary = next(r for r in out["rules"] if r["rule"] == "FirstLastLayersBf16")
    assert boundary["outcome"] == "training BF16 layers [0, 3] are BF16 in the rollout"
    qc = out["engine_config"]
    assert (qc["quant_method"], qc["quant_algo"]) == ("modelopt", "NVFP4")
    assert "model.layers.3.mlp.experts" in qc["ignore"] and "model.layers.2.mlp.experts" not in qc["ignore"]
    # layer 0 is dense (TINY_MOE's mlp_only_layers), layer 3's experts stay BF16: only layers 1 and 2 quantized
    quantized = {d["name"].split(".")[2] for d in out["tensors"] if d["format"] == "NVFP4"}
    assert quantized == {"1", "2"}
