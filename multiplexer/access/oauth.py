"""OAuth 2.1 bearer tokens on ``/mcp``: the gateway as a resource server (MCP authorization spec).

A JWT is checked with ``joserfc`` against the issuer's JWKS: signature, ``iss``, ``aud`` (this
gateway, so a token meant for another service is refused: no token passthrough), ``exp``, and the
scopes ``server.oauth.scopes`` requires. The key set is cached for ``jwks_ttl_s`` and fetched again
at once for an unknown ``kid`` (the issuer rotated its keys), at most every ``REFETCH_S``. Opaque
tokens go to ``introspection_url`` (RFC 7662) when no JWKS is configured, the gateway
authenticating there with its client id and secret (HTTP Basic, section 2.1); an active answer
is trusted for ``introspection_cache_s`` at most, so a token revoked at the authorization server
stops working within it. A verified JWT is remembered until its ``exp``.

A user's identity is ``oauth:<sub>``; a client's own token (client credentials: no ``sub``, or
``sub`` equal to ``client_id`` as RFC 9068 writes one) is ``oauth:client:<client_id>``, so a
client and a user of the same name never share jobs, files or spend. The claim ``team_claim``
names the team whose access it gets.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote_plus

import anyio
import httpx
from joserfc import jwt
from joserfc.errors import ExpiredTokenError, InvalidKeyIdError, JoseError
from joserfc.jwk import KeySet
from joserfc.jwt import JWTClaimsRegistry

from multiplexer.access.bearer import InsufficientScope, InvalidToken, TokenIdentity, metadata_url
from multiplexer.access.settings import OAuthSettings

log = logging.getLogger(__name__)
ALGORITHMS = ["RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"]
REFETCH_S = 10.0  # an unknown kid refetches the key set at most this often (a flood cannot hammer it)
LEEWAY_S = 30
MAX_VERIFIED = 10_000
CLIENT = "client:"  # the identities of clients acting for themselves: oauth:client:<client_id>


def basic_credentials(client_id: str, secret: str) -> str:
    """The ``Authorization`` value of RFC 6749 section 2.3.1: each part form-urlencoded, then
    joined and base64-encoded (what an introspection endpoint expects of a client)."""
    raw = f"{quote_plus(client_id)}:{quote_plus(secret)}".encode()
    return "Basic " + base64.b64encode(raw).decode()


def identity_of(claims: dict[str, Any]) -> str:
    """``oauth:<sub>`` for a user, ``oauth:client:<client_id>`` for a client acting for itself."""
    sub, client = claims.get("sub"), claims.get("client_id")
    sub = sub if isinstance(sub, str) and sub else None
    client = client if isinstance(client, str) and client else None
    if sub is not None and sub != client:
        if sub.startswith(CLIENT):  # would read as a client's identity
            raise InvalidToken(f"the token's subject may not begin with {CLIENT!r}")
        return f"oauth:{sub}"
    if client is not None:
        return f"oauth:{CLIENT}{client}"
    raise InvalidToken("the token names no subject")


class TokenVerifier:
    def __init__(self, settings: OAuthSettings, wall: Callable[[], float] = time.time,
                 client: httpx.AsyncClient | None = None) -> None:
        self.settings = settings
        self.resource = settings.resource or settings.audience
        self.metadata_url = metadata_url(self.resource)
        self.wall = wall
        self._client = client
        self._keys: KeySet | None = None
        self._fetched = -1e18  # wall time of the last fetch
        self._refreshed = -1e18  # ... and of the last one an unknown kid asked for
        self._lock = anyio.Lock()
        self.fetches = 0
        # sha256(token) -> its caller and until when it is trusted (a JWT's exp; an introspected
        # token's introspection_cache_s, at most)
        self._verified: dict[bytes, tuple[TokenIdentity, float]] = {}
        secret = settings.introspection_client_secret
        self._basic = None if settings.introspection_client_id is None or secret is None else \
            basic_credentials(settings.introspection_client_id, secret.get_secret_value())
        claims: dict[str, Any] = {"iss": {"essential": True, "value": settings.issuer},
                                  "aud": {"essential": True, "value": settings.audience},
                                  "exp": {"essential": True}}
        self._registry = JWTClaimsRegistry(now=lambda: int(self.wall()), leeway=LEEWAY_S, **claims)

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=10.0)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def key_set(self, refresh: bool = False) -> KeySet:
        """The issuer's keys: cached, fetched again when stale or (``refresh``) for a new kid."""
        async with self._lock:
            now = self.wall()
            age = now - self._fetched
            refresh = refresh and now - self._refreshed > REFETCH_S
            if refresh:
                self._refreshed = now
            if self._keys is None or age > self.settings.jwks_ttl_s or refresh:
                assert self.settings.jwks_url is not None
                try:
                    r = await self.client().get(self.settings.jwks_url)
                    r.raise_for_status()
                    self._keys = KeySet.import_key_set(r.json())
                except (httpx.HTTPError, ValueError, JoseError) as e:
                    if self._keys is None:
                        raise InvalidToken(f"the issuer's keys cannot be fetched ({type(e).__name__})") \
                            from None
                else:
                    self._fetched = self.wall()
                    self.fetches += 1
            assert self._keys is not None
            return self._keys

    async def verify(self, token: str) -> TokenIdentity:
        """The token's caller; a token verified before is answered from memory while it is
        trusted (a client sends the same token with every request)."""
        key = hashlib.sha256(token.encode()).digest()
        known = self._verified.get(key)
        if known is not None and known[1] > self.wall():
            return known[0]
        found, until = await self._verify(token)
        if len(self._verified) >= MAX_VERIFIED:
            self._verified.clear()
        if until > self.wall():
            self._verified[key] = (found, until)
        return found

    async def _verify(self, token: str) -> tuple[TokenIdentity, float]:
        if self.settings.jwks_url:
            claims, trusted = await self._jwt(token), None  # until its exp (always there)
        else:
            claims = await self._introspect(token)
            trusted = self.wall() + self.settings.introspection_cache_s
        scopes = frozenset(str(claims.get("scope", "")).split())
        missing = [s for s in self.settings.scopes if s not in scopes]
        if missing:
            raise InsufficientScope(" ".join(self.settings.scopes))
        team = claims.get(self.settings.team_claim)
        exp = claims.get("exp")
        expires_at = float(exp) if isinstance(exp, int | float) else None
        found = TokenIdentity(identity_of(claims), team if isinstance(team, str) else None, scopes,
                              expires_at)
        ends = [t for t in (trusted, expires_at) if t is not None]
        return found, min(ends, default=0.0)

    async def _jwt(self, token: str) -> dict[str, Any]:
        try:
            try:
                decoded = jwt.decode(token, await self.key_set(), algorithms=ALGORITHMS)
            except InvalidKeyIdError:  # a key the issuer added since: fetch the set again, once
                decoded = jwt.decode(token, await self.key_set(refresh=True), algorithms=ALGORITHMS)
            self._registry.validate(decoded.claims)
        except InvalidKeyIdError:
            raise InvalidToken("the token's key (kid) is not the issuer's") from None
        except ExpiredTokenError:
            raise InvalidToken("the token has expired") from None
        except JoseError as e:
            raise InvalidToken(f"the token is not valid here ({e.error}: {e.description or ''})".strip()) \
                from None
        except ValueError as e:
            raise InvalidToken(f"the token is malformed ({e})") from None
        return dict(decoded.claims)

    async def _introspect(self, token: str) -> dict[str, Any]:
        """RFC 7662: the authorization server says whether an opaque token is active, and for whom."""
        assert self.settings.introspection_url is not None and self._basic is not None
        try:
            r = await self.client().post(self.settings.introspection_url,
                                         data={"token": token, "token_type_hint": "access_token"},
                                         headers={"authorization": self._basic})
            if r.status_code in (401, 403):  # the operator's to fix: say so once per refusal
                log.warning("the introspection endpoint refused the gateway's client credentials "
                            "(HTTP %d): check introspection_client_id and its secret", r.status_code)
            r.raise_for_status()
            claims = r.json()
        except (httpx.HTTPError, ValueError):
            raise InvalidToken("the token cannot be introspected now") from None
        if not isinstance(claims, dict) or claims.get("active") is not True:
            raise InvalidToken("the token is not active")
        try:
            self._registry.validate({**claims, "iss": claims.get("iss", self.settings.issuer)})
        except ExpiredTokenError:
            raise InvalidToken("the token has expired") from None
        except JoseError as e:
            raise InvalidToken(f"the token is not valid here ({e.error})") from None
        return claims
