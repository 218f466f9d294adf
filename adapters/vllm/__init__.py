"""vLLM rollout adapter: engine arguments from the plan, refit through vLLM's layerwise reload.

Nothing here imports vllm at module level: `hooks.VllmHooks.from_vllm()` and `client` import it
inside the code paths that run on a real engine, so the fakes exercise every other line on CPU.
"""
