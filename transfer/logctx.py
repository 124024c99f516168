"""Which request a log line is about: engine, room and CP rank (or consumer), on every line.

A fetch and an exporter's request handlers bind the request's fields in a context
variable; asyncio tasks they start inherit it. `RequestFilter` puts them on each record as
`%(request)s` (empty outside a request), so a service's log format can show them:

    handler.addFilter(RequestFilter())
    logging.Formatter("%(asctime)s %(name)s %(levelname)s %(request)s%(message)s")
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator

__all__ = ["request_context", "RequestFilter", "current"]

_request: contextvars.ContextVar[str] = contextvars.ContextVar("pdkv_request", default="")


def current() -> str:
    """The bound fields as `key=value ... ` (with a trailing space), or ""."""
    return _request.get()


@contextlib.contextmanager
def request_context(**fields: object) -> Iterator[None]:
    """Bind `fields` (engine, room, rank, consumer...) for the lines logged inside."""
    text = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
    token = _request.set(f"[{text}] " if text else "")
    try:
        yield
    finally:
        _request.reset(token)


class RequestFilter(logging.Filter):
    """Adds `record.request`: the bound fields of the request being served, or ""."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request = _request.get()
        return True
