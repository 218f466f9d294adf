"""The benchmark suite (`refit bench SUITE`). Each suite is a module with `run(quick) -> BenchReport`."""

from __future__ import annotations

# Suite name -> module. Explicit, imported lazily.
SUITES: dict[str, str] = {
    "codecs": "app.bench.codecs",
    "export": "app.bench.export",
    "logprobs": "app.bench.logprobs",
    "refit": "app.bench.refit",
    "sharded": "app.bench.sharded",
    "transport": "app.bench.transport",
}
