"""The HTTP request a call came in on, for the records its calls leave (set by the face that
noted the request: ``faces/access.py``; None for calls no HTTP request carried)."""

from __future__ import annotations

from contextvars import ContextVar

REQUEST_ID: ContextVar[bytes | None] = ContextVar("multiplexer_request_id", default=None)
