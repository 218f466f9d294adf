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
    # the attached deployment over SGLang's HTTP API (http_client.py): its routes, their request
    # structs, what the scheduler does with a tensor payload, and the serializer ported in serializer.py
    ("values", "sglang.srt.entrypoints.http_server:server_info", ("/server_info",)),
    ("contains", "sglang.srt.entrypoints.http_server:server_info", ("build_server_info(server_args",)),
    ("contains", "sglang.srt.utils.common:build_server_info", ("server_args.resolved_dict()",)),
    ("field", "sglang.srt.arg_groups.fields.parallel:tp_size", ()),
    ("field", "sglang.srt.arg_groups.fields.model:model_path", ()),
    ("values", "sglang.srt.entrypoints.http_server:pause_generation", ("/pause_generation",)),
    ("symbol", "sglang.srt.managers.io_struct:PauseGenerationReqInput", ("mode",)),
    ("values", "sglang.srt.managers.io_struct:PauseGenerationReqInput", ("abort", "retract", "in_place")),
    ("values", "sglang.srt.entrypoints.http_server:continue_generation", ("/continue_generation",)),
    ("values", "sglang.srt.entrypoints.http_server:begin_weight_update", ("/begin_weight_update",)),
    ("values", "sglang.srt.entrypoints.http_server:end_weight_update", ("/end_weight_update",)),
    ("values", "sglang.srt.entrypoints.http_server:update_weights_from_tensor", ("/update_weights_from_tensor",)),
    ("contains", "sglang.srt.entrypoints.http_server:update_weights_from_tensor",
     ('"success": success', "HTTPStatus.BAD_REQUEST")),
    ("symbol", "sglang.srt.managers.io_struct:UpdateWeightsFromTensorReqInput",
     ("serialized_named_tensors", "load_format", "flush_cache")),
    ("values", "sglang.srt.entrypoints.http_server:flush_cache", ("/flush_cache",)),
    ("contains", "sglang.srt.entrypoints.http_server:flush_cache", ("HTTPStatus.BAD_REQUEST",)),
    ("contains", "sglang.srt.managers.scheduler_components.weight_updater:"
                 "SchedulerWeightUpdaterManager.update_weights_from_tensor", ("deserialize_own_rank",)),
    ("contains", "sglang.srt.managers.tp_worker:BaseTpWorker.deserialize_own_rank",
     ("MultiprocessingSerializer.deserialize", "serialized_named_tensors[get_parallel().tp_rank]")),
    ("contains", "sglang.srt.utils.common:MultiprocessingSerializer.serialize",
     ("ForkingPickler(buf).dump(obj)", "pybase64.b64encode(output)")),
    ("contains", "sglang.srt.utils.common:MultiprocessingSerializer.deserialize",
     ("pybase64.b64decode(data, validate=True)", "SafeUnpickler(io.BytesIO(data)).load()")),
    ("values", "sglang.srt.utils.common:SafeUnpickler",
     ("rebuild_tensor", "rebuild_storage_filename", "rebuild_typed_storage", "rebuild_cuda_tensor",
      "rebuild_storage_empty", "_rebuild_tensor_v2")),
    ("contains", "sglang.srt.utils.patch_torch:_reduce_tensor_modified",
     ("_REDUCE_TENSOR_ARG_DEVICE_INDEX", "_device_to_uuid")),
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
