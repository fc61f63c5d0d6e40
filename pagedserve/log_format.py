"""`--log-format json`: one JSON object per log line, with the trace and span ids of the span
current where the line was logged (when tracing is on), so a log pipeline can join logs to
traces."""

from __future__ import annotations

import datetime
import json
import logging

from opentelemetry import trace


class JsonFormatter(logging.Formatter):
    def __init__(self, command: str) -> None:
        super().__init__()
        self._command = command

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(),
            "level": record.levelname, "service": self._command, "logger": record.name,
            "message": record.getMessage()}
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:
            entry["trace_id"] = format(span_context.trace_id, "032x")
            entry["span_id"] = format(span_context.span_id, "016x")
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(level: str, log_format: str, command: str) -> None:
    """The root logger on stderr: `text` lines, or `json` objects."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter(command))
    else:
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s {command} %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
