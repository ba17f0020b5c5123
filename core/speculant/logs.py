"""One logging mechanism: structlog, on top of the standard library's logging.

Every module logs with ``log = speculant.logs.get_logger(__name__)`` and key-value events
(``log.warning("plugin failed to load", plugin=name, error=...)``). The events are stdlib log
records under the module's name, so a user filters them as any Python logging
(``logging.getLogger("speculant.plugins").setLevel(...)``) and pytest's caplog sees them; what
other libraries log (aiohttp) goes through the same renderer. ``configure`` (the commands call
it; ``--log-format``) renders everything to stderr as one line an event, ``console`` (key=value)
or ``json``.
"""
from __future__ import annotations

import logging
import sys

import structlog

FORMATS = ("console", "json")

_SHARED = [
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso"),
]

structlog.configure(
    processors=[structlog.stdlib.filter_by_level, *_SHARED, structlog.processors.StackInfoRenderer(),
                structlog.processors.format_exc_info, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
    logger_factory=structlog.stdlib.LoggerFactory(),
    wrapper_class=structlog.stdlib.BoundLogger,
    cache_logger_on_first_use=False,  # structlog.testing.capture_logs must reach loggers made earlier
)


def get_logger(name: str):
    """The logger for a module: under "speculant." whatever package it is in (speculant_cpu.backend
    logs as speculant.speculant_cpu.backend), so that one level or filter covers every plugin."""
    return structlog.stdlib.get_logger(name if name == "speculant" or name.startswith("speculant.") else f"speculant.{name}")


def configure(fmt: str = "console", level: int | str = logging.INFO, stream=None) -> None:
    """Render every log record (ours and other libraries') to `stream` (stderr) in `fmt`
    ("console": timestamp level event key=value; "json": one object a line); speculant's own
    loggers from `level` on, other libraries' from WARNING."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.processors.KeyValueRenderer(
        key_order=["timestamp", "level", "event", "logger"], drop_missing=True)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer], foreign_pre_chain=_SHARED))
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_speculant", False)]:
        root.removeHandler(old)
    handler._speculant = True
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    logging.getLogger("speculant").setLevel(level)
