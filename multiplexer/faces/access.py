"""One line per HTTP request on the ``multiplexer.access`` logger, its request id, and its count.

Every request, on the ASGI path (``Access``, the outermost app) or called directly by the
gateway's own server (``faces/server_protocol.py``), gets a ``Note`` in its scope's extensions:
the request id (a client's ``x-request-id`` when it is a plain token, else a new one, returned
in ``x-request-id`` either way) and what the endpoint learned on the way (the key's configured
name, never the key; the route, JSON-RPC method or model; the JSON-RPC error code). At the end
the request is counted in ``multiplexer_http_requests_total`` by route template and status, and,
with ``server.access_log``, logged at INFO as ``plain`` text or a ``json`` object
(``server.log_format``). A line costs a log record (microseconds), so it is built only when the
logger would emit it.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import secrets
import time
from typing import Any

from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from multiplexer.core.call import Outcome
from multiplexer.core.jsonrpc import Decoded
from multiplexer.core.metrics import Metrics
from multiplexer.gateway.config import ServerConfig
from multiplexer.records.context import REQUEST_ID as CALLS_REQUEST

ACCESS = "multiplexer.access"  # the logger, and the note's key in a request's scope extensions
REQUEST_ID = b"x-request-id"
OTHER = "other"  # the route label of a path no route serves
log = logging.getLogger(ACCESS)
_TOKEN = re.compile(rb"[!-~]{1,128}")  # a client's request id we echo: visible ASCII, no spaces
_PREFIX = b"req_" + secrets.token_hex(8).encode()  # this process's, random
_IDS = itertools.count()
_MAX_SHOWN = 120  # characters of a client's method or path shown in a line


def new_request_id() -> bytes:
    """Unique per request: a random prefix per process and a counter (32 hex digits, as a uuid4's
    would be, without the system's random source on every request)."""
    return b"%s%016x" % (_PREFIX, next(_IDS))


class Note:
    """What a request's line says; endpoints fill in what they learn."""

    __slots__ = ("calls", "code", "key", "rid", "route", "start")

    def __init__(self, rid: bytes, start: float) -> None:
        self.rid = rid
        self.start = start
        self.key: str | None = None
        self.route: str | None = None
        self.code: int | None = None
        self.calls: int | None = None  # the calls of a JSON-RPC array


def note_of(scope: Scope) -> Note | None:
    extensions = scope.get("extensions")
    return extensions.get(ACCESS) if extensions else None


def note_rpc(note: Note, decoded: Decoded, outcomes: list[Outcome | None]) -> None:
    """A ``/rpc`` body's first method (and how many calls an array held) and first error code."""
    entries = decoded.entries
    first = entries[0].call if entries else None
    note.route = first.method if first is not None else None
    note.calls = len(entries) if decoded.batch else None
    for entry, outcome in zip(entries, outcomes, strict=True):
        error = entry.error or (outcome.error if outcome is not None else None)
        if error is not None:
            note.code = error.code
            return


def _shown(text: str) -> str:
    """A client's string as one plain token: cut short, and quoted if it has spaces or controls."""
    text = text[:_MAX_SHOWN]
    return text if text.isprintable() and " " not in text and text else json.dumps(text)


class AccessLog:
    def __init__(self, server: ServerConfig, metrics: Metrics, routes: list[BaseRoute]) -> None:
        self.enabled = server.access_log
        self.json = server.log_format == "json"
        self.metrics = metrics
        self.exact: set[str] = set()
        self.templates: list[tuple[re.Pattern[str], str]] = []
        for route in routes:
            if not isinstance(route, Route):
                continue
            if "{" in route.path:
                self.templates.append((route.path_regex, route.path))
            else:
                self.exact.add(route.path)

    def route_label(self, path: str) -> str:
        """The route serving ``path`` as it is configured (``/v1/files/{file_id}``), never the path
        a client sent: labels stay a fixed set."""
        if path in self.exact:
            return path
        for regex, template in self.templates:
            if regex.match(path):
                return template
        return OTHER

    def begin(self, scope: Scope) -> Note:
        rid = None
        for name, value in scope["headers"]:
            if name == REQUEST_ID:
                rid = value if _TOKEN.fullmatch(value) else None
                break
        note = Note(rid or new_request_id(), time.perf_counter())
        CALLS_REQUEST.set(note.rid)  # the request log's records of its calls say it
        extensions = scope.get("extensions")
        if extensions is None:
            extensions = scope["extensions"] = {}
        extensions[ACCESS] = note
        return note

    def end(self, scope: Scope, note: Note, status: int) -> None:
        path = scope["path"]
        self.metrics.http_answered(self.route_label(path), status)
        if self.enabled and log.isEnabledFor(logging.INFO):
            self._line(scope["method"], path, note, status)

    def _line(self, method: str, path: str, note: Note, status: int) -> None:
        ms = (time.perf_counter() - note.start) * 1000
        rid = note.rid.decode("ascii")
        fields: dict[str, Any] | None = None
        if self.json:
            fields = {"method": method, "path": path, "route": note.route, "key": note.key,
                      "status": status, "code": note.code, "calls": note.calls,
                      "ms": round(ms, 3), "request_id": rid}
            message = json.dumps(fields)
        else:
            message = (f"{method} {_shown(path)} {status} {ms:.2f}ms route={_shown(note.route or '-')}"
                       f" key={note.key or '-'}")
            if note.code is not None:
                message += f" code={note.code}"
            if note.calls is not None:
                message += f" calls={note.calls}"
            message += f" rid={rid}"
        # a record without the caller lookup that log.info does (a stack walk per request)
        record = log.makeRecord(ACCESS, logging.INFO, __file__, 0, message, (), None)
        if fields is not None:
            record.access = fields
        log.handle(record)


class Access:
    """The outermost ASGI app: a note, the request id header and the end of each HTTP request.

    It passes on what the gateway's own server reads from its app (``direct``,
    ``max_header_bytes``) and gives it ``access`` for the requests it calls directly."""

    def __init__(self, app: Any, access: AccessLog) -> None:
        self.app: ASGIApp = app
        self.access = access
        self.direct = app.direct
        self.max_header_bytes = app.max_header_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        access = self.access
        note = access.begin(scope)
        status = 499  # the client went away before an answer started

        async def send_noted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (REQUEST_ID, note.rid)]
            await send(message)

        try:
            await self.app(scope, receive, send_noted)
        except Exception:
            status = 500  # the server answers it so
            raise
        finally:
            access.end(scope, note, status)


class JsonLines(logging.Formatter):
    """Every record as one JSON object (``server.log_format: json`` under ``multiplexer serve``):
    time, level, logger and message, or an access line's fields in place of its message."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname,
                               "logger": record.name}
        fields = getattr(record, "access", None)
        if isinstance(fields, dict):
            out.update(fields)
        else:
            out["msg"] = record.getMessage()
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)
