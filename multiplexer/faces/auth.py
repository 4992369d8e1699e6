"""Client authentication: bearer API keys compared in constant time, mapped to identities."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Mapping

from pydantic import SecretStr

from multiplexer.access.entries import KeyEntry, entry
from multiplexer.access.secrets import digest, given_digest
from multiplexer.core.errors import Code, RpcError


class Authenticator:
    def __init__(self, api_keys: Mapping[str, SecretStr | KeyEntry]) -> None:
        self._keys = [(name, digest(secret)) for name, value in api_keys.items()
                      if (secret := entry(value).key.get_secret_value())]
        self.enabled = bool(api_keys)

    def identify(self, authorization: str | None) -> str | None:
        """The identity for a header value; raises -32005 when keys are on and it is not valid."""
        if not self.enabled:
            return None
        if not authorization:
            raise RpcError(Code.UNAUTHORIZED, "Unauthorized", {"detail": "missing bearer key"})
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise RpcError(Code.UNAUTHORIZED, "Unauthorized",
                           {"detail": "malformed Authorization header"})
        given = given_digest(token.strip())
        found = None
        for name, key in self._keys:  # check every key: no early exit timing
            if hmac.compare_digest(given, key):
                found = name
        if found is None:
            raise RpcError(Code.UNAUTHORIZED, "Unauthorized", {"detail": "unknown key"})
        return found


def is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
