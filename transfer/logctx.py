"""Which request a log line is about: engine, room and CP rank (or consumer), on every line.

A fetch and an exporter's request handlers bind the request's fields in a context
variable; asyncio tasks they start inherit it. `RequestFilter` puts them on each record as
`%(request)s` (empty outside a request), so a service's log format can show them:

    handler.addFilter(RequestFilter())
    logging.Formatter("%(asctime)s %(name)s %(levelname)s %(request)s%(message)s")
"""

from __future__ import annotations

import contextvars
import logging

__all__ = ["request_context", "RequestContext", "RequestFilter", "current"]

# The fields as given: formatted only when a line is logged, since a fetch through the GPU
# lane takes well under a millisecond and binds them on every call.
_request: contextvars.ContextVar[dict[str, object] | None] = contextvars.ContextVar("pdkv_request", default=None)


def current() -> str:
    """The bound fields as `[key=value ...] ` (with a trailing space), or ""."""
    fields = _request.get()
    text = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None) if fields else ""
    return f"[{text}] " if text else ""


def request_context(**fields: object) -> RequestContext:
    """Bind `fields` (engine, room, rank, consumer...) for the lines logged inside."""
    return RequestContext(fields)


class RequestContext:
    """`with` it: its fields are the request's for the block (a class rather than a
    generator-based context manager: entered on every fetch, and cheaper so)."""

    __slots__ = ("_fields", "_token")

    def __init__(self, fields: dict[str, object]) -> None:
        self._fields = fields

    def __enter__(self) -> None:
        self._token = _request.set(self._fields)

    def __exit__(self, *exc: object) -> None:
        _request.reset(self._token)


class RequestFilter(logging.Filter):
    """Adds `record.request`: the bound fields of the request being served, or ""."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request = current()
        return True
