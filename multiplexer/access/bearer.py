"""What the MCP face needs of OAuth without the JOSE library: the refusals, the challenge header,
where the metadata lives. ``access.oauth`` (joserfc, the ``oauth`` extra) verifies the tokens."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit


class InvalidToken(Exception):
    """401 ``invalid_token``, with why (``error_description``)."""


class InsufficientScope(Exception):
    """403 ``insufficient_scope``: a valid token without the scopes the gateway requires."""


@dataclass(frozen=True, slots=True)
class TokenIdentity:
    identity: str
    team: str | None
    scopes: frozenset[str]
    expires_at: float | None


def metadata_url(resource: str) -> str:
    """Where the Protected Resource Metadata of ``resource`` is served (RFC 9728, path inserted)."""
    parts = urlsplit(resource)
    return f"{parts.scheme}://{parts.netloc}/.well-known/oauth-protected-resource{parts.path.rstrip('/')}"


def challenge(metadata: str, error: str | None = None, description: str | None = None,
              scope: str | None = None) -> str:
    """The ``WWW-Authenticate`` value: where the metadata is, and what went wrong if anything."""
    parts = []
    if error is not None:
        parts.append(f'error="{error}"')
    if description is not None:
        parts.append('error_description="{}"'.format(description.replace('"', "'")))
    if scope is not None:
        parts.append(f'scope="{scope}"')
    parts.append(f'resource_metadata="{metadata}"')
    return "Bearer " + ", ".join(parts)
