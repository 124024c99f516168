"""Which request a log line is about: engine, room and CP rank (or consumer), on every line.

A fetch and an exporter's request handlers bind the request's fields in a context
variable; asyncio tasks they start inherit it. `RequestFilter` puts them on each record,
both as separate attributes (`record.room`, `record.engine`, `record.cp_rank`,
`record.peer`, `record.consumer`: None where unknown), for a structured handler, and
preformatted as `%(request)s` (empty outside a request) for a text format:

    handler.addFilter(RequestFilter())
    logging.Formatter("%(asctime)s %(name)s %(levelname)s %(request)s%(message)s")

A failure that ends a room or a fetch is logged at WARNING with `extra=failure_fields(...)`,
so its fields are on the record whatever handler formats it. `JsonFormatter` writes a
record as one JSON object (the app turns it on through `logging.config`, see
docs/deployment.md); the library itself never installs a handler.
"""

from __future__ import annotations

import contextvars
import json
import logging

# The record attributes every line gets (None where unknown); `rank` as bound is `cp_rank`.
FIELDS = ("room", "engine", "cp_rank", "peer", "consumer")
_ALIASES = {"rank": "cp_rank"}

# The fields as given: formatted only when a line is logged, since a fetch through the GPU
# lane takes well under a millisecond and binds them on every call.
_request: contextvars.ContextVar[dict[str, object] | None] = contextvars.ContextVar("pdkv_request", default=None)


def current() -> str:
    """The bound fields as `[key=value ...] ` (with a trailing space), or ""."""
    fields = _request.get()
    text = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None) if fields else ""
    return f"[{text}] " if text else ""


def _bound() -> dict[str, object]:
    """The bound fields under their record names (`FIELDS`), None where not bound."""
    out: dict[str, object] = dict.fromkeys(FIELDS)
    for key, value in (_request.get() or {}).items():
        name = _ALIASES.get(key, key)
        if name in out and value is not None:
            out[name] = value
    return out


def failure_fields(error: BaseException | None = None, **given: object) -> dict[str, object]:
    """`extra=` for the line of a failure: room, engine, cp_rank, peer (and consumer), from
    `given` first, then what `error` names (a `PeerLostError`'s owner and peer), then the
    request's bound fields; None where none knows."""
    out = _bound()
    owner = getattr(error, "owner", None)
    if isinstance(owner, tuple) and len(owner) == 2:
        out["engine"], out["cp_rank"] = owner
    peer = getattr(error, "peer", None)
    if peer:
        out["peer"] = peer
    for key, value in given.items():
        if value is not None:
            out[_ALIASES.get(key, key)] = value
    return out


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
    """Adds `record.request` (the bound fields preformatted, or "") and each of `FIELDS`
    as its own attribute, unless the line's `extra=` gave it already."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request = current()
        bound = _bound()
        for name in FIELDS:
            if getattr(record, name, None) is None:
                setattr(record, name, bound[name])
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, the request's fields that are
    known (`FIELDS`, as `RequestFilter` or `extra=` put them), and the exception if any."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)
