"""Hugging Face checkpoint directories: a streaming safetensors reader and a
streaming writer of sharded safetensors checkpoints. Both speak the safetensors format themselves,
with ordinary reads and writes (a source is never memory-mapped: see safetensors_file)."""
