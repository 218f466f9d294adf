"""Hugging Face checkpoint directories: a streaming safetensors reader (a WeightExporter) and a
streaming writer of sharded safetensors checkpoints. Imports safetensors inside its modules."""
