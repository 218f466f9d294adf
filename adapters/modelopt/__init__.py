"""ModelOpt adapter: rollout plans as nvidia-modelopt quantization configs, for QAT (needs the `modelopt` extra)."""
