"""rollout.engine_kwargs.sglang: the SGLang plugin's own configuration section (adapters.plugins),
declared once, key by key (domain.settings.setting)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from domain.errors import ConfigError
from domain.settings import NoneType, _hf_overrides, _url, declare, setting

PATH = "rollout.engine_kwargs.sglang"


@attrs.frozen(kw_only=True)
class SglangEngineConfig:
    """rollout.engine_kwargs.sglang: the SGLang engine's settings."""

    hf_overrides: Mapping[str, Any] | None = setting(
        (dict, str, NoneType), None,
        "the same for SGLang",
        check=_hf_overrides, free=True)
    use_deep_gemm: bool | None = setting(
        (bool, NoneType), None,
        "the same for SGLang")
    kv_cache_dtype: str = setting(
        (str,), "auto",
        "SGLang's `kv_cache_dtype`: auto, fp8_e4m3, fp8_e5m2",
        choices=("auto", "fp8_e4m3", "fp8_e5m2"))
    url: str | None = setting(
        (str, NoneType), None,
        "attached: the SGLang server's base URL (`http://HOST:PORT`), started with "
        "`--custom-weight-loader adapters.sglang.loader.load` on this host "
        "([attach](attach.md#8-sglang)); rl-refit starts nothing and never stops it",
        check=_url)
    api_key: str | None = setting(
        (str, NoneType), None,
        "attached: the server's `--api-key` or `--admin-api-key`, when it has one")
    pause_mode: str = setting(
        (str,), "retract",
        "attached: SGLang's pause mode around a refit: in-flight requests go back to the queue and "
        "continue after it, their KV recomputed with the new weights (`retract`), freeze on their old KV "
        "(`in_place`; SGLang then refuses to flush the cache while they run), or are dropped (`abort`)",
        choices=("retract", "in_place", "abort"))


    def replicas(self, deployment: str, configured: int) -> int:
        """How many engines a deployment refits: one. SGLang runs in this process or attached to
        one server you started.

        Raises ConfigError naming the key: several attached replicas, or a disaggregated deployment.
        """
        if deployment == "disaggregated":
            raise ConfigError("rollout.deployment", "sglang runs colocated only (sglang.Engine in this process), or "
                              "attached to a server you started (rollout.deployment=attached)")
        if deployment == "attached" and configured > 1:
            raise ConfigError("rollout.replicas", f"an attached SGLang deployment refits one server ({PATH}.url): "
                              "set rollout.replicas=1")
        return configured

    def attached_url(self, replica: int) -> str:
        """The attached server's URL. Raises ConfigError naming the key when none is given."""
        if not self.url:
            raise ConfigError(f"{PATH}.url", "rollout.deployment=attached refits a server you started: give its URL "
                              "(http://HOST:PORT)")
        return self.url


declare(SglangEngineConfig, f"{PATH}.")
