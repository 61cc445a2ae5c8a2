"""Process logging: plain text, or one JSON object a line carrying the request ids (the mesh's and the
client's own) and the trace id."""

from __future__ import annotations

import json
import logging
import os
import time

from opentelemetry import baggage, trace

from pdmesh.telemetry.tracing import CLIENT_REQUEST_ID_KEY, REQUEST_ID_KEY

DEBUG_LOGGERS_ENV = "PDMESH_DEBUG_LOGGERS"  # comma-separated logger names logged at DEBUG (e.g. every pull's timing)
TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
_OWN_LOGGERS = ("pdmesh", "kvstore", "worker", "prefill", "decode")   # what configure_engine_logging sets up


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        span_context = trace.get_current_span().get_span_context()
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": baggage.get_baggage(REQUEST_ID_KEY) or None,
            "client_request_id": baggage.get_baggage(CLIENT_REQUEST_ID_KEY) or None,
            "trace_id": format(span_context.trace_id, "032x") if span_context.is_valid else None,
            "span_id": format(span_context.span_id, "016x") if span_context.is_valid else None,
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(log_format: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    _apply_debug_loggers()


def configure_engine_logging() -> None:
    """In an engine's processes, where vLLM configures only its own loggers: pdmesh's records get a
    time and their logger's name (not Python's bare last-resort line), and the debug loggers apply.
    Nothing changes where the process already has handlers (a worker's main process, tests)."""
    if logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    for name in _OWN_LOGGERS:
        own = logging.getLogger(name)
        if not own.handlers:
            own.addHandler(handler)
            own.setLevel(logging.INFO)
            own.propagate = False
    _apply_debug_loggers()


def _apply_debug_loggers() -> None:
    for name in filter(None, (n.strip() for n in os.environ.get(DEBUG_LOGGERS_ENV, "").split(","))):
        logging.getLogger(name).setLevel(logging.DEBUG)
