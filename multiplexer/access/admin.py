"""The admin (master) key: the one credential of `/admin/` and the dashboard.

From ``server.admin_key`` or ``MULTIPLEXER_MASTER_KEY`` (the environment wins, so a deployment can
keep it out of files). Without one, nothing admin is served at all: every admin endpoint answers
404 saying how to turn it on. Kept only as a digest."""

from __future__ import annotations

import os

from pydantic import SecretStr

from multiplexer.access.secrets import digest, matches
from multiplexer.core.errors import Code, RpcError

ENV = "MULTIPLEXER_MASTER_KEY"
OFF = ("the admin API is off: set server.admin_key in the config (or sha256:<hex> of it) "
       f"or {ENV} in the gateway's environment")


class AdminKey:
    def __init__(self, configured: SecretStr | None, environ: dict[str, str] | None = None) -> None:
        env = (os.environ if environ is None else environ).get(ENV, "")
        secret = env or (configured.get_secret_value() if configured is not None else "")
        self._digest = digest(secret) if secret else None

    @property
    def enabled(self) -> bool:
        return self._digest is not None

    def check(self, authorization: str | None) -> None:
        """Raise the refusal for a header that does not carry the admin key (-32005)."""
        if self._digest is None:
            raise RpcError(Code.NOT_FOUND, "Not Found", {"detail": OFF})
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise RpcError(Code.UNAUTHORIZED, "Unauthorized", {"detail": "missing admin bearer key"})
        if not matches(token.strip(), self._digest):
            raise RpcError(Code.UNAUTHORIZED, "Unauthorized", {"detail": "not the admin key"})

    def is_admin(self, authorization: str | None) -> bool:
        try:
            self.check(authorization)
        except RpcError:
            return False
        return True
