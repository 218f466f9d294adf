"""The `refit` command line."""
