"""Reference QAT backend: pure-torch fake-quantization with the exporter's numerics (CPU or GPU)."""
