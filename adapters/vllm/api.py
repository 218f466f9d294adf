"""Every vLLM name the adapter relies on, checked against the source of each supported vLLM release
(VERSIONS) by tests/integration/test_engine_conformance.py (static analysis of the downloaded
wheels).

Entries: (kind, "module:qualname", details). Kinds:
- symbol: the name is bound in the module; details = keyword arguments its def/class accepts.
- member: a method, field or `self.<attr>` of a class; details = keyword arguments of a method.
- env: an environment variable vLLM reads (a key of the module's environment table).
- values: a module-level Literal / list holds these string values.
- contains: the function's source contains these snippets (a behaviour the adapter relies on).
"""

from __future__ import annotations

from adapters.vllm.profile import PINNED_VLLM

PACKAGE, VERSION = "vllm", PINNED_VLLM
VERSIONS = ("0.32.0", PINNED_VLLM)  # 0.32 also runs for real in tests/vllm (the CPU build)

USES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # layerwise reload (hooks.py)
    ("symbol", "vllm.model_executor.model_loader.reload:initialize_layerwise_reload", ()),
    ("symbol", "vllm.model_executor.model_loader.reload:finalize_layerwise_reload", ()),
    ("symbol", "vllm.model_executor.model_loader.reload.layerwise:initialize_layerwise_reload", ("model",)),
    ("symbol", "vllm.model_executor.model_loader.reload.layerwise:finalize_layerwise_processing",
     ("model", "model_config")),
    ("contains", "vllm.model_executor.model_loader.reload.layerwise:_layerwise_process",
     ("process_weights_after_loading(layer)", "_copy_and_restore_kernel_tensors")),
    ("contains", "vllm.model_executor.model_loader.reload.layerwise:make_online_process_loader",
     ("info.loaded_weights.append",)),
    ("symbol", "vllm.model_executor.model_loader.mtp_validation:disable_mtp_completeness_check", ()),
    # KV-cache scales
    ("symbol", "vllm.model_executor.layers.quantization.kv_cache:BaseKVCacheMethod", ("quant_config",)),
    ("member", "vllm.model_executor.layers.quantization.kv_cache:BaseKVCacheMethod.quant_config", ()),
    ("symbol", "vllm.model_executor.layers.attention.attention:set_default_quant_scales", ("register_buffer",)),
    ("contains", "vllm.model_executor.layers.attention.attention:set_default_quant_scales",
     ("layer._k_scale.fill_(1.0)", "layer._prob_scale.fill_(1.0)")),
    ("member", "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors:"
               "CompressedTensorsConfig.kv_cache_scheme", ()),
    # the worker extension (extension.py, server.py): injected into the worker class by name,
    # methods called by name through collective_rpc
    ("symbol", "vllm.engine.arg_utils:EngineArgs", ("worker_extension_cls",)),
    ("member", "vllm.config.parallel:ParallelConfig.worker_extension_cls", ()),
    ("contains", "vllm.v1.worker.worker_base:WorkerWrapperBase.init_worker",
     ("worker_extension_cls", "__bases__")),
    ("member", "vllm.v1.worker.worker_base:WorkerBase.rank", ()),
    ("member", "vllm.v1.worker.gpu_worker:Worker.model_runner", ()),
    ("member", "vllm.v1.worker.gpu_model_runner:GPUModelRunner.get_model", ()),
    ("contains", "vllm.v1.executor.multiproc_executor:WorkerProc._execute_worker_rpc", ("getattr(self.worker, method)",)),
    ("contains", "vllm.v1.serial_utils:run_method", ("getattr(obj, method)",)),
    # experts whose post-processing the reload skips (experts.py)
    ("symbol", "vllm.model_executor.layers.fused_moe.modular_kernel:FusedMoEExperts", ()),
    ("member", "vllm.model_executor.layers.fused_moe.modular_kernel:FusedMoEExperts.process_weights_after_loading", ()),
    ("member", "vllm.model_executor.layers.fused_moe.modular_kernel:FusedMoEKernel.fused_experts", ()),
    ("symbol", "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:UnquantizedFusedMoEMethod", ()),
    ("contains", "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method:"
                 "UnquantizedFusedMoEMethod._setup_kernel",
     ("is_weight_update = self.moe_kernel is not None", "fused_experts.process_weights_after_loading(layer)")),
    ("member", "vllm.model_executor.layers.fused_moe.fused_moe_method_base:FusedMoEMethodBase.moe_kernel", ()),
    ("symbol", "vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts", ()),
    ("member", "vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts._padded_intermediate_size", ()),
    ("member", "vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts.isa", ()),
    ("contains", "vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts.process_weights_after_loading",
     ("self._use_zentorch", "self._pad_moe_intermediate(layer)", "cpu_prepack_moe_weight(layer.w13_weight, self.isa)")),
    ("contains", "vllm._custom_ops:cpu_prepack_moe_weight", ("torch.ops._C.prepack_moe_weight(weight, output, isa)",)),
    # workers (worker.py) and the engine (engine.py, client.py)
    ("symbol", "vllm.config:set_current_vllm_config", ()),
    ("member", "vllm.v1.worker.worker_base:WorkerBase.vllm_config", ()),
    ("member", "vllm.entrypoints.llm:LLM.collective_rpc", ("args",)),
    ("member", "vllm.entrypoints.llm:LLM.generate", ("use_tqdm", "lora_request")),
    # the adapter mode (lora.py): adapters built in the workers as vLLM builds one from disk
    ("symbol", "vllm.lora.request:LoRARequest", ("lora_name", "lora_int_id", "lora_path")),
    ("member", "vllm.lora.lora_model:LoRAModel.from_lora_tensors",
     ("lora_model_id", "tensors", "peft_helper", "device", "dtype", "model_vocab_size", "weights_mapper",
      "skip_prefixes")),
    ("member", "vllm.lora.peft_helper:PEFTHelper.from_dict", ()),
    ("member", "vllm.lora.peft_helper:PEFTHelper.validate_legal", ()),
    ("contains", "vllm.lora.worker_manager:WorkerLoRAManager._load_adapter",
     ("PEFTHelper.from_local_dir", "peft_helper.validate_legal(self.lora_config)", "get_rename_mapper()",
      "lora_skip_prefixes", "self._adapter_manager._validate_moe_lora_format(lora)")),
    ("symbol", "vllm.lora.lora_model:LoRAModel", ()),
    ("symbol", "vllm.lora.peft_helper:PEFTHelper", ()),
    ("contains", "vllm.lora.lora_model:LoRAModel.from_local_checkpoint", ("return cls.from_lora_tensors(",)),
    ("member", "vllm.lora.worker_manager:WorkerLoRAManager.list_adapters", ()),
    ("member", "vllm.lora.worker_manager:WorkerLoRAManager.remove_adapter", ()),
    ("member", "vllm.lora.model_manager:LRUCacheLoRAModelManager.add_adapter", ()),
    ("member", "vllm.lora.model_manager:LoRAModelManager.capacity", ()),
    ("contains", "vllm.v1.worker.lora_model_runner_mixin:LoRAModelRunnerMixin.load_lora_model",
     ("self.lora_manager = LRUCacheWorkerLoRAManager(",)),
    ("member", "vllm.entrypoints.llm:LLM.reset_prefix_cache", ()),
    ("symbol", "vllm.engine.arg_utils:EngineArgs",
     ("enable_lora", "max_loras", "max_cpu_loras", "max_lora_rank", "lora_target_modules")),
    ("symbol", "vllm:SamplingParams", ()),
    ("symbol", "vllm:LLM", ()),
    ("symbol", "vllm.sampling_params:SamplingParams", ("max_tokens", "temperature", "prompt_logprobs", "ignore_eos")),
    ("symbol", "vllm.inputs:TokensPrompt", ()),
    ("symbol", "vllm.inputs.llm:TokensPrompt", ("prompt_token_ids",)),
    ("member", "vllm.outputs:RequestOutput.prompt_logprobs", ()),
    ("member", "vllm.outputs:RequestOutput.outputs", ()),
    ("member", "vllm.outputs:CompletionOutput.token_ids", ()),
    ("member", "vllm.logprobs:Logprob.logprob", ()),
    # engine arguments and environment (factory.py)
    ("symbol", "vllm.engine.arg_utils:EngineArgs",
     ("hf_overrides", "quantization", "linear_backend", "moe_backend", "kv_cache_dtype", "load_format")),
    # what the GPU check (tests/gpu/check_vllm_refit.py) passes besides
    ("symbol", "vllm.engine.arg_utils:EngineArgs",
     ("model", "skip_tokenizer_init", "dtype", "seed", "max_model_len", "kv_cache_memory_bytes",
      "gpu_memory_utilization", "compilation_config")),
    ("member", "vllm.config.compilation:CompilationConfig.cudagraph_capture_sizes", ()),
    ("values", "vllm.config.kernel:MoEBackend", ("auto", "deep_gemm", "flashinfer_trtllm", "flashinfer_cutlass")),
    ("values", "vllm.config.kernel:LinearBackend", ("auto", "deep_gemm", "flashinfer_trtllm", "flashinfer_cutlass")),
    ("env", "vllm.envs:VLLM_USE_DEEP_GEMM", ()),
    ("env", "vllm.envs:VLLM_MOE_USE_DEEP_GEMM", ()),
    ("env", "vllm.envs:VLLM_USE_DEEP_GEMM_E8M0", ()),
    ("env", "vllm.envs:VLLM_ENABLE_V1_MULTIPROCESSING", ()),
    ("env", "vllm.envs:VLLM_LOGGING_STREAM", ()),
    # the baselines of `refit bench engine` (bench_extension.py): vLLM's own reload from disk,
    # and the checkpoint-format tensors its layerwise reload records per layer
    ("member", "vllm.v1.worker.gpu_worker:Worker.reload_weights", ()),
    ("member", "vllm.v1.worker.gpu_model_runner:GPUModelRunner.reload_weights",
     ("weights_path", "is_checkpoint_format")),
    ("member", "vllm.config.load:LoadConfig.load_format", ()),
    ("member", "vllm.config.model:ModelConfig.model", ()),
    ("member", "vllm.config.model:ModelConfig.model_weights", ()),
    ("member", "vllm.config.model:ModelConfig.revision", ()),
    ("symbol", "vllm.model_executor.model_loader.reload.layerwise:get_layerwise_info", ("layer",)),
    ("symbol", "vllm.model_executor.model_loader.reload.meta:restore_layer_on_meta", ("layer", "info")),
    ("symbol", "vllm.model_executor.model_loader.reload.meta:materialize_layer", ("layer", "info")),
    ("contains", "vllm.model_executor.model_loader.reload.layerwise:make_online_process_loader",
     ("@wraps(original_loader", "def online_process_loader")),
    # the CPU emulation plugin (cpu_emulation.py, fp8_block_kernel.py): vLLM's per-platform kernel
    # tables it extends, the kernels it registers, the base class of its FP8 block kernel
    ("symbol", "vllm.platforms:PlatformEnum", ()),
    ("symbol", "vllm.platforms:current_platform", ()),
    ("symbol", "vllm.model_executor.kernels.linear:_POSSIBLE_FP8_BLOCK_KERNELS", ()),
    ("symbol", "vllm.model_executor.kernels.linear:_POSSIBLE_MXFP8_KERNELS", ()),
    ("symbol", "vllm.model_executor.kernels.linear:_POSSIBLE_MXFP4_KERNELS", ()),
    ("symbol", "vllm.model_executor.kernels.linear:_POSSIBLE_NVFP4_KERNELS", ()),
    ("symbol", "vllm.model_executor.kernels.linear.mxfp8.emulation:EmulationMxfp8LinearKernel", ()),
    ("symbol", "vllm.model_executor.kernels.linear.mxfp4.emulation:EmulationMxfp4LinearKernel", ()),
    ("symbol", "vllm.model_executor.kernels.linear.nvfp4.emulation:EmulationNvFp4LinearKernel", ()),
    ("symbol", "vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel:Fp8BlockScaledMMLinearKernel", ()),
    ("member", "vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel:"
               "Fp8BlockScaledMMLinearKernel.apply_block_scaled_mm", ()),
    ("symbol", "vllm.model_executor.layers.quantization.input_quant_fp8:QuantFP8", ()),
    # emulated MoE experts (moe_emulation.py, moe_emulation_experts.py): the expert-backend
    # look-ups wrapped where the compressed-tensors MoE methods call them, and what the experts use
    ("symbol", "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
               "compressed_tensors_moe_w8a8_fp8:select_fp8_moe_backend", ()),
    ("symbol", "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
               "compressed_tensors_moe_w8a8_mxfp8:select_mxfp8_moe_backend", ()),
    ("symbol", "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
               "compressed_tensors_moe_w4a4_nvfp4:select_nvfp4_moe_backend", ()),
    ("symbol", "vllm.model_executor.layers.fused_moe.activation:MoEActivation", ()),
    ("symbol", "vllm.model_executor.layers.fused_moe.config:FusedMoEConfig", ()),
    ("symbol", "vllm.model_executor.layers.fused_moe.config:FusedMoEParallelConfig", ()),
    ("symbol", "vllm.model_executor.layers.fused_moe.config:FusedMoEQuantConfig", ()),
    ("symbol", "vllm.model_executor.layers.fused_moe.experts.triton_moe:TritonExperts", ()),
    ("symbol", "vllm.model_executor.layers.fused_moe.oracle.fp8:Fp8MoeBackend", ()),
    ("symbol", "vllm.model_executor.layers.fused_moe.oracle.nvfp4:NvFp4MoeBackend", ()),
    ("symbol", "vllm.model_executor.layers.fused_moe.topk_weight_and_reduce:TopKWeightAndReduceNoOP", ()),
    ("symbol", "vllm.model_executor.layers.quantization.utils.mxfp8_utils:MXFP8_BLOCK_SIZE", ()),
    ("symbol", "vllm.model_executor.layers.quantization.utils.mxfp8_utils:dequant_mxfp8_to_bf16", ()),
    ("symbol", "vllm.model_executor.layers.quantization.utils.mxfp8_utils:mxfp8_e4m3_quantize", ()),
    ("symbol", "vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils:dequantize_to_dtype", ()),
    ("symbol", "vllm.model_executor.layers.quantization.utils.quant_utils:GroupShape", ()),
    ("symbol", "vllm.model_executor.layers.quantization.utils.quant_utils:QuantKey", ()),
    ("symbol", "vllm.model_executor.layers.quantization.utils.quant_utils:kFp8Dynamic128Sym", ()),
    ("symbol", "vllm.model_executor.layers.quantization.utils.quant_utils:kFp8Static128BlockSym", ()),
    ("symbol", "vllm.model_executor.layers.quantization.utils.quant_utils:kMxfp8Dynamic", ()),
    ("symbol", "vllm.model_executor.layers.quantization.utils.quant_utils:kMxfp8Static", ()),
    ("symbol", "vllm.model_executor.layers.quantization.utils.quant_utils:kNvfp4Static", ()),
    ("symbol", "vllm.model_executor.layers.quantization.utils.quant_utils:kNvfp4DynamicToken", ()),
    # the rl_refit weight-transfer backend (transfer_backend.py: worker side; transfer_trainer.py:
    # trainer side; plugin.py registers it), and the attached engine's control (controls.py)
    ("symbol", "vllm.distributed.weight_transfer.base:WeightTransferEngine", ()),
    ("member", "vllm.distributed.weight_transfer.base:WeightTransferEngine.parse_update_info", ()),
    ("member", "vllm.distributed.weight_transfer.base:WeightTransferEngine.update_weights", ()),
    ("member", "vllm.distributed.weight_transfer.base:WeightTransferEngine.receive_weights", ()),
    ("member", "vllm.distributed.weight_transfer.base:WeightTransferEngine.init_transfer_engine", ()),
    ("member", "vllm.distributed.weight_transfer.base:WeightTransferEngine.start_weight_update", ()),
    ("member", "vllm.distributed.weight_transfer.base:WeightTransferEngine.finish_weight_update", ()),
    ("member", "vllm.distributed.weight_transfer.base:WeightTransferEngine.shutdown", ()),
    ("symbol", "vllm.distributed.weight_transfer.base:WeightTransferInitInfo", ()),
    ("symbol", "vllm.distributed.weight_transfer.base:WeightTransferUpdateInfo", ()),
    ("symbol", "vllm.distributed.weight_transfer.base:WeightTransferInitRequest", ()),
    ("symbol", "vllm.distributed.weight_transfer.base:WeightTransferUpdateRequest", ()),
    ("symbol", "vllm.distributed.weight_transfer.base:TrainerInitInfo", ()),
    ("symbol", "vllm.distributed.weight_transfer.base:TrainerWeightTransferEngine", ()),
    ("member", "vllm.distributed.weight_transfer.base:TrainerWeightTransferEngine.trainer_init", ()),
    ("member", "vllm.distributed.weight_transfer.base:TrainerWeightTransferEngine.send_weights", ()),
    ("symbol", "vllm.distributed.weight_transfer.factory:WeightTransferEngineFactory", ()),
    ("member", "vllm.distributed.weight_transfer.factory:WeightTransferEngineFactory.register_engine", ()),
    ("symbol", "vllm.distributed.weight_transfer.factory:WeightTransferTrainerFactory", ()),
    ("member", "vllm.distributed.weight_transfer.factory:WeightTransferTrainerFactory.register_engine", ()),
    ("contains", "vllm.v1.worker.gpu_worker:Worker.load_model", ("WeightTransferEngineFactory.create_engine",)),
    ("contains", "vllm.v1.worker.gpu_worker:Worker.update_weights", ("self._weight_update_active = False",)),
    ("symbol", "vllm.model_executor.model_loader.reload.inplace:reload_weights",
     ("vllm_config", "model", "weights_iterator", "weights_path", "is_checkpoint_format")),
    ("member", "vllm.v1.engine.async_llm:AsyncLLM.pause_generation", ("mode",)),
    ("member", "vllm.v1.engine.async_llm:AsyncLLM.resume_generation", ()),
    ("member", "vllm.v1.engine.async_llm:AsyncLLM.reset_prefix_cache", ()),
    ("member", "vllm.v1.engine.async_llm:AsyncLLM.update_weight_version", ()),
    ("member", "vllm.v1.engine.async_llm:AsyncLLM.get_weight_version", ()),
    ("member", "vllm.v1.engine.async_llm:AsyncLLM.collective_rpc", ("args",)),
    ("member", "vllm.v1.engine.async_llm:AsyncLLM.init_weight_transfer_engine", ()),
    ("member", "vllm.v1.engine.async_llm:AsyncLLM.start_weight_update", ()),
    ("member", "vllm.v1.engine.async_llm:AsyncLLM.update_weights", ()),
    ("member", "vllm.v1.engine.async_llm:AsyncLLM.finish_weight_update", ()),
    ("contains", "vllm.entrypoints.openai.completion.protocol:CompletionRequest", ("prompt_logprobs", "return_token_ids")),
)
