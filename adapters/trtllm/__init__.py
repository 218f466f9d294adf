"""TRT-LLM: no refit adapter yet; its profile says what `refit plan` accepts for it."""
