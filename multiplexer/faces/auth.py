"""Client authentication: bearer API keys mapped to identities, by digest: the YAML's compared in
constant time, the store's (``access.directory``) found by one dict lookup, and a bearer neither
knows asked of the store itself (rate-limited there), since another worker may have made it."""

from __future__ import annotations

import hmac
import ipaddress
import math
import time
from collections.abc import Mapping
from typing import Any

from pydantic import SecretStr

from multiplexer.access.entries import KeyEntry, entry
from multiplexer.access.secrets import digest, given_digest
from multiplexer.core.errors import unauthorized


class Authenticator:
    def __init__(self, api_keys: Mapping[str, SecretStr | KeyEntry], directory: Any = None) -> None:
        self.use(api_keys)
        self.directory = directory if directory is not None and directory.enabled else None

    def use(self, api_keys: Mapping[str, SecretStr | KeyEntry]) -> None:
        """The config's keys (at start, and after a config reload: both lists swapped at once)."""
        self._keys = [(name, digest(secret)) for name, value in api_keys.items()
                      if (secret := entry(value).key.get_secret_value())]
        self._expires = {name: e.expires_at.timestamp() for name, value in api_keys.items()
                         if (e := entry(value)).expires_at is not None}

    @property
    def enabled(self) -> bool:
        """Whether a caller needs a key: the config names some, or the store has issued one (an
        admin key alone, for `/admin/` and the dashboard, leaves keyless callers served). The
        store's first key counts on every worker and replica at once, loaded here or not."""
        return bool(self._keys) or (self.directory is not None and self.directory.keys_required())

    def identify(self, authorization: str | None) -> str | None:
        """The identity for a header value; raises -32005 when keys are on and it is not valid."""
        if not self.enabled:
            return None
        if not authorization:
            raise unauthorized("missing bearer key")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise unauthorized("malformed Authorization header")
        given = given_digest(token.strip())
        if self.directory is not None and (stored := self.directory.identify(given)) is not None:
            return stored  # type: ignore[no-any-return]
        found = None
        for name, key in self._keys:  # check every key: no early exit timing
            if hmac.compare_digest(given, key):
                found = name
        if found is None and self.directory is not None:
            found = self.directory.identify_new(given)  # made since the snapshot, elsewhere
            if found is not None:
                return found
        if found is None:
            raise unauthorized("unknown key")
        if self._expires and time.time() >= (ends := self._expires.get(found, math.inf)):
            raise unauthorized("key expired", ends)
        return found


def is_loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
