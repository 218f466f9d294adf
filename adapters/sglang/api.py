"""Every SGLang name the adapter relies on, checked against the pinned SGLang's source by
tests/integration/test_engine_conformance.py. Entry kinds as in adapters/vllm/api.py, plus
`field`: an annotated field of some class in the module (SGLang's server-argument groups).
"""

from __future__ import annotations

from adapters.sglang.profile import PINNED_SGLANG

PACKAGE, VERSION = "sglang", PINNED_SGLANG

USES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # the weight-update session (engine.py)
    ("symbol", "sglang:Engine", ()),
    ("member", "sglang.srt.entrypoints.engine:Engine.begin_weight_update", ()),
    ("member", "sglang.srt.entrypoints.engine:Engine.end_weight_update", ()),
    ("member", "sglang.srt.entrypoints.engine:Engine.update_weights_from_tensor", ("load_format", "flush_cache")),
    # the adapter mode (engine.py: stage, commit, abort; requests name the adapter by lora_path)
    ("member", "sglang.srt.entrypoints.engine:Engine.load_lora_adapter_from_tensors",
     ("lora_name", "tensors", "config_dict")),
    ("member", "sglang.srt.entrypoints.engine:Engine.unload_lora_adapter", ("lora_name",)),
    ("member", "sglang.srt.entrypoints.engine:Engine.flush_cache", ()),
    ("member", "sglang.srt.entrypoints.engine:Engine.generate", ("lora_path",)),
    ("field", "sglang.srt.arg_groups.fields.lora:enable_lora", ()),
    # how SGLang calls the custom loader, and what end_weight_update runs (loader.py)
    ("contains", "sglang.srt.model_executor.model_runner_components.weight_updater:"
                 "WeightUpdater.update_weights_from_tensor",
     ("self.custom_weight_loaders", "custom_loader(self.get_model(), named_tensors)")),
    ("contains", "sglang.srt.model_executor.model_runner_components.weight_updater:WeightUpdater.end_weight_update",
     ("DefaultModelLoader.postprocess_weights",)),
    ("contains", "sglang.srt.model_loader.loader:DefaultModelLoader.postprocess_weights",
     ("quant_method.process_weights_after_loading(module)",)),
    ("member", "sglang.srt.layers.quantization.base_config:QuantizeMethodBase.process_weights_after_loading", ()),
    ("member", "sglang.srt.layers.quantization.base_config:QuantizeMethodBase.restore_weights_before_loading", ()),
    ("contains", "sglang.srt.model_loader.loader:DefaultModelLoader.load_weights_only",
     ('"mxfp8"', "weight_scale")),
    # server arguments (engine_args.py)
    ("field", "sglang.srt.arg_groups.fields.model:custom_weight_loader", ()),
    ("field", "sglang.srt.arg_groups.fields.model:json_model_override_args", ()),
    ("field", "sglang.srt.arg_groups.fields.model:quantization", ()),
    ("field", "sglang.srt.arg_groups.fields.model:kv_cache_dtype", ()),
    ("field", "sglang.srt.arg_groups.fields.exec_:moe_runner_backend", ()),
    ("field", "sglang.srt.arg_groups.fields.exec_:fp8_gemm_runner_backend", ()),
    ("values", "sglang.srt.arg_groups.choices:MOE_RUNNER_BACKEND_CHOICES", ("auto", "deep_gemm")),
    ("values", "sglang.srt.arg_groups.choices:FP8_GEMM_RUNNER_BACKEND_CHOICES", ("auto", "deep_gemm")),
)
