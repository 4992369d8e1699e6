"""An exception a face did not expect: logged once with its traceback, counted in ``/metrics``
as an internal error, and answered as one in the face's own shape, never as a bare
``Internal Server Error`` with a traceback in the log only.

Each face catches where it already awaits its work (``/rpc``'s body, a ``/v1`` endpoint, the MCP
server's request middleware), so the catch costs a request nothing until something breaks.
"""

from __future__ import annotations

import logging

from multiplexer.core.errors import Code, RpcError, internal_error
from multiplexer.core.metrics import code_label
from multiplexer.gateway.gateway import UNROUTED, Gateway

log = logging.getLogger("multiplexer.faces")


def unexpected(gateway: Gateway, where: str, exc: BaseException) -> RpcError:
    """Call inside the ``except``: logs ``exc`` with its traceback, counts it, and returns the
    error the caller is told (its kind, no detail: the log has that)."""
    log.exception("%s failed unexpectedly", where)
    gateway.metrics.call_answered(UNROUTED, code_label(Code.INTERNAL_ERROR))
    return internal_error(f"{type(exc).__name__} in the gateway (details in its log)")
