"""structlog configuration: done once, by the CLI or bootstrap, never at import time."""

from __future__ import annotations

import logging
import sys

import structlog

_configured = False


class _CurrentStderr:
    """Writes to whatever sys.stderr is at the time of the write (pytest swaps it per test)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(*, json: bool = False, level: int = logging.INFO) -> None:
    """Configure structlog once; later calls are no-ops.

    Args:
        json: render JSON lines (machines) instead of the console renderer (people).
        level: the minimum level that is printed.
    """
    global _configured
    if _configured:
        return
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,  # keeps structlog.testing.capture_logs working after setup
    )
    _configured = True
