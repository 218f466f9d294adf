"""compressed-tensors adapter: the engine's quantization_config, built with the library's objects.

Nothing is imported here; `adapters.compressed_tensors.quantization_config` imports the package.
"""
