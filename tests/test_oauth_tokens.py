"""The OAuth token verifier on its own, its issuer and introspection endpoint played by respx:
introspection authenticates with the gateway's client credentials (RFC 7662 section 2.1, the
secret in no log) and trusts an answer at most ``introspection_cache_s``; clients and users never
share an identity; forged and ill-formed JWTs (``alg: none``, HS256 keyed with the issuer's
public key, a wrong ``iss``, no ``exp``, a future ``nbf``) are refused."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest
import respx
from cryptography.hazmat.primitives import serialization
from joserfc import jwt
from joserfc.jwk import ECKey, KeySet, RSAKey
from pydantic import SecretStr, ValidationError

from multiplexer.access.bearer import InvalidToken
from multiplexer.access.oauth import TokenVerifier
from multiplexer.access.settings import OAuthSettings

pytestmark = pytest.mark.anyio
ISSUER = "https://issuer.example"
AUDIENCE = "https://gw.example/mcp"
JWKS = ISSUER + "/jwks"
INTROSPECT = ISSUER + "/introspect"
CLIENT_ID = "gw client"
SECRET = SecretStr("s3cr/t:+x")  # characters the form encoding changes


class Wall:
    """The verifier's wall clock, moved by hand."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def raw_token(header: dict[str, Any], claims: dict[str, Any], sign: Callable[[bytes], bytes]) -> str:
    """A JWT assembled by hand, for what a JOSE library will not sign (``alg: none``, an HMAC
    keyed with a public key)."""
    signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
    return f"{signing_input}.{b64(sign(signing_input.encode()))}"


@pytest.fixture
def router() -> Iterator[respx.MockRouter]:
    with respx.mock(assert_all_called=False) as mock:
        yield mock


def introspecting(wall: Wall, **settings: Any) -> TokenVerifier:
    return TokenVerifier(OAuthSettings(
        issuer=ISSUER, audience=AUDIENCE, introspection_url=INTROSPECT,
        introspection_client_id=CLIENT_ID, introspection_client_secret=SECRET, **settings),
        wall=wall, client=httpx.AsyncClient())


class Endpoint:
    """An RFC 7662 endpoint: answers from ``tokens`` to a caller with the right Basic credentials."""

    def __init__(self, router: respx.MockRouter, wall: Wall) -> None:
        self.tokens: dict[str, dict[str, Any]] = {}
        self.wall = wall
        self.seen: list[tuple[str, dict[str, list[str]]]] = []
        self.route = router.post(INTROSPECT).mock(side_effect=self.answer)

    def active(self, token: str, **claims: Any) -> None:
        self.tokens[token] = {"active": True, "aud": AUDIENCE, "sub": "bo",
                              "exp": int(self.wall()) + 3600, **claims}

    def answer(self, request: httpx.Request) -> httpx.Response:
        form = parse_qs(request.content.decode())
        self.seen.append((request.headers.get("authorization", ""), form))
        expected = "Basic " + base64.b64encode(b"gw+client:s3cr%2Ft%3A%2Bx").decode()
        if request.headers.get("authorization") != expected:
            return httpx.Response(401, json={"error": "invalid_client"})
        return httpx.Response(200, json=self.tokens.get(form["token"][0], {"active": False}))


async def test_introspection_sends_the_gateways_client_credentials_and_never_logs_the_secret(
        router: respx.MockRouter, caplog: Any) -> None:
    caplog.set_level(logging.DEBUG)
    wall = Wall()
    endpoint = Endpoint(router, wall)
    endpoint.active("opaque-1", team="red")
    found = await introspecting(wall).verify("opaque-1")
    assert (found.identity, found.team) == ("oauth:bo", "red")
    authorization, form = endpoint.seen[0]
    user, _, password = base64.b64decode(authorization.removeprefix("Basic ")).decode().partition(":")
    assert (user, password) == ("gw+client", "s3cr%2Ft%3A%2Bx")  # RFC 6749 2.3.1: form-encoded
    assert form == {"token": ["opaque-1"], "token_type_hint": ["access_token"]}

    wrong = TokenVerifier(OAuthSettings(
        issuer=ISSUER, audience=AUDIENCE, introspection_url=INTROSPECT,
        introspection_client_id=CLIENT_ID, introspection_client_secret=SecretStr("not-it")), wall=wall,
        client=httpx.AsyncClient())
    with pytest.raises(InvalidToken, match="cannot be introspected"):
        await wrong.verify("opaque-1")
    assert "refused the gateway's client credentials (HTTP 401)" in caplog.text
    for secret in ("s3cr/t:+x", "not-it", "s3cr%2Ft", authorization.removeprefix("Basic ")):
        assert secret not in caplog.text
        assert secret not in repr(OAuthSettings(
            issuer=ISSUER, audience=AUDIENCE, introspection_url=INTROSPECT,
            introspection_client_id=CLIENT_ID, introspection_client_secret=SECRET))


def test_introspection_without_client_credentials_is_refused_at_load() -> None:
    partials: list[dict[str, Any]] = [{}, {"introspection_client_id": CLIENT_ID},
                                      {"introspection_client_secret": SECRET}]
    for partial in partials:
        with pytest.raises(ValidationError, match="introspection_client_id and introspection_client_secret"):
            OAuthSettings(issuer=ISSUER, audience=AUDIENCE, introspection_url=INTROSPECT, **partial)
    with pytest.raises(ValidationError, match="set jwks_url"):
        OAuthSettings(issuer=ISSUER, audience=AUDIENCE)
    assert OAuthSettings(issuer=ISSUER, audience=AUDIENCE, jwks_url=JWKS).introspection_cache_s == 60


async def test_a_revoked_opaque_token_stops_working_within_the_cache_ttl(router: respx.MockRouter) -> None:
    """Trusted 60 s (the default), though its exp is an hour away: asked once in that time, then
    asked again, and refused once the authorization server says it is no longer active."""
    wall = Wall()
    endpoint = Endpoint(router, wall)
    endpoint.active("opaque-2")
    verifier = introspecting(wall)
    assert (await verifier.verify("opaque-2")).identity == "oauth:bo"
    del endpoint.tokens["opaque-2"]  # revoked at the authorization server
    wall.now += 59.9
    assert (await verifier.verify("opaque-2")).identity == "oauth:bo"
    assert endpoint.route.call_count == 1
    wall.now += 0.2
    with pytest.raises(InvalidToken, match="not active"):
        await verifier.verify("opaque-2")
    assert endpoint.route.call_count == 2


async def test_the_introspection_cache_follows_its_setting_and_never_outlives_exp(
        router: respx.MockRouter) -> None:
    wall = Wall()
    endpoint = Endpoint(router, wall)
    endpoint.active("short-lived", exp=int(wall()) + 10)
    endpoint.active("long-lived")
    verifier = introspecting(wall, introspection_cache_s=5)
    await verifier.verify("short-lived")
    await verifier.verify("long-lived")
    wall.now += 4.9
    await verifier.verify("long-lived")
    assert endpoint.route.call_count == 2
    wall.now += 0.2  # 5.1 s: past the setting
    await verifier.verify("long-lived")
    assert endpoint.route.call_count == 3

    never = introspecting(wall, introspection_cache_s=0)
    await never.verify("long-lived")
    await never.verify("long-lived")
    assert endpoint.route.call_count == 5

    cached = introspecting(wall, introspection_cache_s=600)
    await cached.verify("short-lived")  # exp in 4.9 s: trusted until then, not 600 s
    assert endpoint.route.call_count == 6
    del endpoint.tokens["short-lived"]  # past its exp the authorization server calls it inactive
    wall.now += 4.8
    await cached.verify("short-lived")
    wall.now += 0.2
    with pytest.raises(InvalidToken, match="not active"):
        await cached.verify("short-lived")
    assert endpoint.route.call_count == 7


@pytest.mark.parametrize(("claims", "identity"), [
    ({"client_id": "alice"}, "oauth:client:alice"),  # client credentials: no sub
    ({"sub": "alice", "client_id": "alice"}, "oauth:client:alice"),  # RFC 9068's client token
    ({"sub": "alice", "client_id": "web-app"}, "oauth:alice"),  # a user, through a client
    ({"sub": "alice"}, "oauth:alice"),
])
async def test_a_client_and_a_user_of_the_same_name_are_different_callers(
        router: respx.MockRouter, claims: dict[str, Any], identity: str) -> None:
    wall = Wall()
    endpoint = Endpoint(router, wall)
    endpoint.active("t")
    endpoint.tokens["t"].pop("sub")
    endpoint.tokens["t"].update(claims)
    assert (await introspecting(wall).verify("t")).identity == identity


async def test_a_subject_that_would_read_as_a_client_is_refused(router: respx.MockRouter) -> None:
    wall = Wall()
    endpoint = Endpoint(router, wall)
    endpoint.active("t", sub="client:alice")
    with pytest.raises(InvalidToken, match="may not begin with 'client:'"):
        await introspecting(wall).verify("t")
    endpoint.active("none")
    endpoint.tokens["none"].pop("sub")
    with pytest.raises(InvalidToken, match="names no subject"):
        await introspecting(wall).verify("none")


class Issuer:
    """An EC and an RSA signing key and the JWKS that publishes them."""

    def __init__(self, router: respx.MockRouter, wall: Wall) -> None:
        self.ec = ECKey.generate_key("P-256", parameters={"kid": "ec"})
        self.rsa = RSAKey.generate_key(2048, parameters={"kid": "rsa"})
        self.wall = wall
        router.get(JWKS).mock(return_value=httpx.Response(
            200, json=KeySet([self.ec, self.rsa]).as_dict(private=False)))

    def claims(self, **changes: Any) -> dict[str, Any]:
        now = int(self.wall())
        body = {"iss": ISSUER, "aud": AUDIENCE, "sub": "ana", "exp": now + 300, "iat": now, **changes}
        return {k: v for k, v in body.items() if v is not None}

    def token(self, **changes: Any) -> str:
        return jwt.encode({"alg": "ES256", "kid": "ec"}, self.claims(**changes), self.ec)

    def public_pem(self, kid: str) -> bytes:
        key = (self.ec if kid == "ec" else self.rsa).get_op_key("verify")
        return key.public_bytes(serialization.Encoding.PEM,  # type: ignore[union-attr]
                                serialization.PublicFormat.SubjectPublicKeyInfo)


@pytest.fixture
def issuer(router: respx.MockRouter) -> tuple[Issuer, TokenVerifier]:
    wall = Wall()
    verifier = TokenVerifier(OAuthSettings(issuer=ISSUER, audience=AUDIENCE, jwks_url=JWKS),
                             wall=wall, client=httpx.AsyncClient())
    return Issuer(router, wall), verifier


async def test_a_well_formed_jwt_is_accepted(issuer: tuple[Issuer, TokenVerifier]) -> None:
    """The control for the refusals below: the same claims, rightly signed, pass (a past nbf too)."""
    keys, verifier = issuer
    assert (await verifier.verify(keys.token(nbf=int(keys.wall()) - 60))).identity == "oauth:ana"
    client = await verifier.verify(keys.token(sub=None, client_id="alice"))
    assert client.identity == "oauth:client:alice"


@pytest.mark.parametrize("case", ["alg none", "HS256 keyed with the EC public key",
                                  "HS256 keyed with the RSA public key", "wrong iss", "missing exp",
                                  "future nbf"])
async def test_forged_and_ill_formed_jwts_are_refused(issuer: tuple[Issuer, TokenVerifier],
                                                      case: str) -> None:
    keys, verifier = issuer
    claims = keys.claims()

    def hs256(kid: str) -> str:
        secret = keys.public_pem(kid)
        return raw_token({"alg": "HS256", "typ": "JWT", "kid": kid}, claims,
                         lambda data: hmac.new(secret, data, hashlib.sha256).digest())

    token = {
        "alg none": lambda: raw_token({"alg": "none", "typ": "JWT"}, claims, lambda _: b""),
        "HS256 keyed with the EC public key": lambda: hs256("ec"),
        "HS256 keyed with the RSA public key": lambda: hs256("rsa"),
        "wrong iss": lambda: keys.token(iss="https://impostor.example"),
        "missing exp": lambda: keys.token(exp=None),
        "future nbf": lambda: keys.token(nbf=int(keys.wall()) + 600),
    }[case]()
    with pytest.raises(InvalidToken) as refused:
        await verifier.verify(token)
    assert str(refused.value)
    with pytest.raises(InvalidToken):  # and not remembered as verified
        await verifier.verify(token)
