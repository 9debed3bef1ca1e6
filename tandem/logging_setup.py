"""The one logging setup of every `tandem` entry point (target, draft, gateway, serve, bench, train-draft).

`TANDEM_LOG_LEVEL` (default INFO) sets the level. `TANDEM_LOG_FORMAT` picks
the format: `text` (default; `<time> <service> <LEVEL> <message>`) or `json`,
one object per line with `time`, `level`, `service`, `logger`, `message`, and
`trace_id`/`span_id` whenever a span is current, so every line written while a
request or a step is being served can be joined with its trace.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import UTC, datetime

LEVEL_ENV = "TANDEM_LOG_LEVEL"
FORMAT_ENV = "TANDEM_LOG_FORMAT"
FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        from opentelemetry import trace

        out: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "service": self.service, "logger": record.name,
            "message": record.getMessage()}
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            out["trace_id"] = format(span.trace_id, "032x")
            out["span_id"] = format(span.span_id, "016x")
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def text_formatter(service: str) -> logging.Formatter:
    return logging.Formatter(f"%(asctime)s {service} %(levelname)s %(message)s")


def setup_logging(service: str) -> None:
    """Send every logger's records to stderr in the configured level and format (replacing any earlier setup)."""
    level_name = os.environ.get(LEVEL_ENV, "INFO").strip().upper() or "INFO"
    level = logging.getLevelName(level_name)
    fmt = os.environ.get(FORMAT_ENV, "text").strip().lower() or "text"
    problems = []
    if not isinstance(level, int):
        problems.append(f"{LEVEL_ENV}={level_name!r} is not a level (DEBUG, INFO, WARNING, ERROR)")
        level = logging.INFO
    if fmt not in FORMATS:
        problems.append(f"{FORMAT_ENV}={fmt!r} is not one of {', '.join(FORMATS)}")
        fmt = "text"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else text_formatter(service))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for problem in problems:  # said once logging works, and not fatal: a typo should not stop a server
        logging.getLogger(__name__).warning("%s; using the default", problem)
