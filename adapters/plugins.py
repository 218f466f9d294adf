"""The engine plugins, by rollout.name: the one table of engines (adapters.engine_plugin.EnginePlugin,
docs/architecture.md#engine-plugins). Reading it imports no engine."""

from __future__ import annotations

from adapters.engine_plugin import DemoDefaults, EnginePlugin
from adapters.reference.engine_plugin import PLUGIN as REFERENCE
from adapters.sglang.engine_plugin import PLUGIN as SGLANG
from adapters.trtllm.engine_plugin import PLUGIN as TRTLLM
from adapters.vllm.engine_plugin import PLUGIN as VLLM

# rollout.name -> its plugin.
PLUGINS: dict[str, EnginePlugin] = {p.name: p for p in (VLLM, SGLANG, TRTLLM, REFERENCE)}
# The engines with a rollout.engine_kwargs section: name -> the section's type.
SECTIONS: dict[str, type] = {p.name: p.section for p in PLUGINS.values() if p.section is not None}
# The environment variables the plugins honour.
ENVIRONMENT: tuple[str, ...] = tuple(v for p in PLUGINS.values() for v in p.environment)
# The engines `refit demo` runs on as real engines.
DEMO_ENGINES: tuple[str, ...] = tuple(p.name for p in PLUGINS.values() if p.demo)
# The engines `refit bench engine` measures against their own ways in.
BENCH_ENGINES: tuple[str, ...] = tuple(p.name for p in PLUGINS.values() if p.bench)


def plugin_for(name: str) -> EnginePlugin:
    """The plugin of rollout.name. Raises ConfigError naming rollout.name and the engines there are."""
    from domain.errors import ConfigError

    if name not in PLUGINS:
        raise ConfigError("rollout.name", f"unknown engine {name!r}; use one of {', '.join(PLUGINS)}")
    return PLUGINS[name]


def demo_of(name: str) -> DemoDefaults:
    """What the demos run on the engine `name` (plugin_for's ConfigError for an unknown one;
    ConfigError naming rollout.name for an engine the demos do not run on)."""
    from domain.errors import ConfigError

    demo = plugin_for(name).demo
    if demo is None:
        raise ConfigError("rollout.name", f"the demos do not run on {name!r}; use one of {', '.join(DEMO_ENGINES)}")
    return demo
