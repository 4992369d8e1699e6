"""Who may read the operator's probes: ``/metrics`` and the details of ``/readyz``.

``/metrics`` names routes, models and key names and counts what each spent, so once callers
need a key (or the address is not loopback) a scrape needs one too: a caller's or the admin's,
unless ``server.metrics_public`` opens it; a caller key's scrape is one request of its key
(its rpm and concurrency). ``/readyz`` answers everyone with its status for load
balancers; what is not ready and why (a store's or Redis's own error text, hosts and users in
it) only the admin key reads.
"""

from __future__ import annotations

from multiplexer.access.admin import AdminKey
from multiplexer.core.errors import Code, RpcError
from multiplexer.faces.auth import Authenticator

ADMIN_ONLY = "the admin key is required here (server.metrics_public: true opens /metrics)"


class ScrapeRefused(Exception):
    """A caller key's scrape refused by its quota (``Quotas.held``): one request of its key."""

    def __init__(self, error: RpcError) -> None:
        super().__init__(error.message)
        self.error = error


class ProbeAccess:
    def __init__(self, auth: Authenticator, admin: AdminKey, *, metrics_public: bool,
                 public: bool) -> None:
        self.auth = auth
        self.admin = admin
        self.metrics_public = metrics_public
        self.public = public  # bound to a non-loopback address

    def check_metrics(self, authorization: str | None) -> str | None:
        """The caller key's identity that scrapes (None: the admin, or an open scrape); raises the
        401's error when ``authorization`` may not. Whether callers need a key is asked on each
        scrape: the key store's first key closes an open scrape."""
        if self.metrics_public or not (self.public or self.auth.enabled):
            return None
        if self.admin.is_admin(authorization):
            return None
        if not self.auth.enabled:  # a public keyless gateway: no caller key exists to present
            raise RpcError(Code.UNAUTHORIZED, "Unauthorized", {"detail": ADMIN_ONLY})
        return self.auth.identify(authorization)

    def readiness_details(self, authorization: str | None) -> bool:
        return self.admin.is_admin(authorization)
