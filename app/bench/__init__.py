"""The benchmark suite (`refit bench SUITE`). Each suite is a module with `run(quick) -> BenchReport`."""

from __future__ import annotations

# Suite name -> module. Explicit, imported lazily. `bench all` runs them in this order: `engine`
# last, since a colocated engine changes its process (threads, environment variables).
SUITES: dict[str, str] = {
    "codecs": "app.bench.codecs",
    "export": "app.bench.export",
    "logprobs": "app.bench.logprobs",
    "refit": "app.bench.refit",
    "sharded": "app.bench.sharded",
    "transport": "app.bench.transport",
    "imports": "app.bench.imports",
    "engine": "app.bench.engine",
}
