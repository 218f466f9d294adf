"""Adapters to the machine itself: installed packages and GPUs (probe), atomic directory publishing (atomic_dir), the export lock and its owner (ownership), input files (files)."""
