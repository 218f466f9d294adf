"""Megatron-Core adapters: fused log-prob forward (hook and legacy), packed GDN layers, exporter."""
