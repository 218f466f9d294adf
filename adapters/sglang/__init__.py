"""SGLang rollout adapter: a weight-update session per refit, a custom loader that stages what
must arrive together, one guarded rebuild after the final marker, and restore on failure.

Nothing here imports sglang at module level; `client.EngineClient` imports it lazily, and the
loader (`loader.load`) runs inside SGLang's scheduler process on the model it is handed.
"""
