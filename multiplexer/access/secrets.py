"""Keys kept as hashes: a secret in config may be written as ``sha256:<hex>`` instead of itself.

A key is compared by its SHA-256 digest in constant time, so the gateway never needs to keep a
plaintext key once it has read its config, and a config file need not hold one either."""

from __future__ import annotations

import hashlib
import hmac
import re

HASHED = re.compile(r"sha256:([0-9a-f]{64})")


def digest(secret: str) -> bytes:
    """The digest a key is stored and compared as (a written ``sha256:<hex>`` is taken as one)."""
    written = HASHED.fullmatch(secret)
    if written:
        return bytes.fromhex(written.group(1))
    return hashlib.sha256(secret.encode()).digest()


def given_digest(token: str) -> bytes:
    """The digest of a key a caller presented (never read as an already hashed form)."""
    return hashlib.sha256(token.encode()).digest()


def matches(token: str, stored: bytes) -> bool:
    return hmac.compare_digest(given_digest(token), stored)


def hashed(secret: str) -> str:
    """What to write in config instead of the key itself."""
    return "sha256:" + digest(secret).hex()
