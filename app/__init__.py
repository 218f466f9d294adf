"""Application services, configuration, the composition root, logging and the CLI."""
