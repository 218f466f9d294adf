"""Trainer adapters over Hugging Face models (`actor.strategy: hf`).

- `adapters.hf.checkpoint.HfCheckpointTrainer`: a checkpoint directory, streamed tensor by tensor
  from its safetensors files (never the whole model in memory).
- `adapters.hf.module.HfModuleTrainer`: a live `transformers` model (what FSDP/TRL-style trainers
  hold), its parameters under the names `save_pretrained` writes.
"""
