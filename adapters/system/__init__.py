"""Adapters that look at the machine itself (installed packages, GPUs)."""
