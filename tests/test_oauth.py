"""OAuth 2.1 on /mcp: the gateway as a resource server. A local issuer (keys made here, its JWKS
served on 127.0.0.1) signs tokens; the official MCP SDK client sends them as bearers. A valid
token is accepted and gets its team's tools; a wrong audience, an expired token, a bad signature
and an unknown kid are refused with the spec's 401 and ``WWW-Authenticate`` challenge."""

from __future__ import annotations

import base64
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from joserfc import jwt
from joserfc.jwk import ECKey, KeySet
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from multiplexer.access.admin import ENV
from multiplexer.gateway.config import parse_config
from multiplexer.server import bind, running, serve_asgi
from tests.mcp_helpers import free_port, mcp_http_client

pytestmark = pytest.mark.anyio
ISSUER = "https://issuer.example"


class Issuer:
    """Signing keys and the JWKS that publishes them (what an authorization server does)."""

    def __init__(self) -> None:
        self.keys = [ECKey.generate_key("P-256", parameters={"kid": "k1"})]
        self.served = 0

    def jwks(self) -> dict[str, Any]:
        return KeySet(self.keys).as_dict(private=False)

    def token(self, audience: str, key: ECKey | None = None, **claims: Any) -> str:
        key = key or self.keys[0]
        body = {"iss": ISSUER, "aud": audience, "sub": "ana", "team": "red", "scope": "mcp",
                "exp": int(time.time()) + 300, **claims}
        return jwt.encode({"alg": "ES256", "kid": key.kid}, body, key)


@pytest.fixture
async def issuer() -> AsyncIterator[tuple[Issuer, str]]:
    keys = Issuer()

    async def jwks(request: Request) -> JSONResponse:
        keys.served += 1
        return JSONResponse(keys.jwks())

    sock = bind("127.0.0.1", 0)
    try:
        async with serve_asgi(Starlette(routes=[Route("/jwks", jwks)]), sock) as url:
            yield keys, url + "/jwks"
    finally:
        sock.close()


@pytest.fixture
async def gateway(issuer: tuple[Issuer, str], monkeypatch: Any) -> AsyncIterator[tuple[str, str]]:
    monkeypatch.delenv(ENV, raising=False)
    _, jwks_url = issuer
    port = free_port()
    audience = f"http://127.0.0.1:{port}/mcp"
    config = parse_config({
        "server": {"teams": {"red": {"tools": ["add", "echo"]}},
                   "oauth": {"issuer": ISSUER, "audience": audience, "jwks_url": jwks_url,
                             "scopes": ["mcp"]}},
        "providers": {"e": {"kind": "echo"}},
        "routes": {"echo": {"provider": "e"}, "add": {"provider": "e"}, "secret": {"provider": "e"}},
    })
    async with running(config, host="127.0.0.1", port=port) as (_, url):
        yield url, audience


def challenge_of(r: httpx.Response) -> dict[str, str]:
    scheme, _, rest = r.headers["www-authenticate"].partition(" ")
    assert scheme == "Bearer"
    return {k.strip(): v.strip().strip('"') for k, _, v in
            (part.partition("=") for part in rest.split('", ')) if k}


async def test_the_metadata_and_the_challenge_tell_a_client_where_to_authenticate(gateway: Any) -> None:
    url, audience = gateway
    async with httpx.AsyncClient() as http:
        r = await http.post(url + "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
        assert r.status_code == 401
        challenge = challenge_of(r)
        assert challenge["resource_metadata"] == url + "/.well-known/oauth-protected-resource/mcp"
        assert "error" not in challenge  # no credentials: no error code (RFC 6750 3.1)
        meta = (await http.get(challenge["resource_metadata"])).json()
        assert meta["resource"] == audience and meta["authorization_servers"] == [ISSUER + "/"]
        assert meta["scopes_supported"] == ["mcp"]


@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_a_valid_token_is_accepted_and_gets_its_teams_tools(gateway: Any, issuer: Any,
                                                                   mode: str) -> None:
    url, audience = gateway
    keys, _ = issuer
    async with mcp_http_client(url + "/mcp", mode, key=keys.token(audience)) as client:
        assert sorted(t.name for t in (await client.list_tools()).tools) == ["add", "echo"]
        assert (await client.call_tool("echo", {"x": 1})).is_error is False


async def test_a_key_the_issuer_added_later_is_fetched_on_its_first_kid(gateway: Any, issuer: Any) -> None:
    url, audience = gateway
    keys, _ = issuer
    async with httpx.AsyncClient() as http:
        ok = await http.post(url + "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
                             headers={"authorization": f"Bearer {keys.token(audience)}",
                                      "accept": "application/json, text/event-stream",
                                      "mcp-protocol-version": "2026-07-28"})
        assert ok.status_code != 401, ok.text
        served = keys.served
        keys.keys.append(ECKey.generate_key("P-256", parameters={"kid": "k2"}))
        token = keys.token(audience, keys.keys[1])
        async with mcp_http_client(url + "/mcp", key=token) as client:
            assert len((await client.list_tools()).tools) == 2
        assert keys.served == served + 1


@pytest.mark.parametrize("case", ["wrong audience", "expired", "bad signature", "unknown kid",
                                  "missing scope", "garbage"])
async def test_bad_tokens_are_refused_with_the_specs_challenge(gateway: Any, issuer: Any, case: str) -> None:
    url, audience = gateway
    keys, _ = issuer
    impostor = ECKey.generate_key("P-256", parameters={"kid": "k1"})
    stranger = ECKey.generate_key("P-256", parameters={"kid": "k9"})
    token = {
        "wrong audience": lambda: keys.token("https://other.example/mcp"),
        "expired": lambda: keys.token(audience, exp=int(time.time()) - 3600),
        "bad signature": lambda: keys.token(audience, impostor),
        "unknown kid": lambda: keys.token(audience, stranger),
        "missing scope": lambda: keys.token(audience, scope="read"),
        "garbage": lambda: "not.a.jwt",
    }[case]()
    async with httpx.AsyncClient() as http:
        r = await http.post(url + "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
                            headers={"authorization": f"Bearer {token}"})
    challenge = challenge_of(r)
    assert challenge["resource_metadata"].endswith("/.well-known/oauth-protected-resource/mcp")
    if case == "missing scope":
        assert r.status_code == 403 and challenge["error"] == "insufficient_scope"
        assert challenge["scope"] == "mcp"
    else:
        assert r.status_code == 401 and challenge["error"] == "invalid_token", r.headers
        assert challenge["error_description"]
    assert r.json()["error"]["code"] == -32005


async def test_a_token_is_refused_by_the_sdk_client_too(gateway: Any, issuer: Any) -> None:
    url, _ = gateway
    keys, _ = issuer
    with pytest.raises(Exception) as refused:
        async with mcp_http_client(url + "/mcp", key=keys.token("https://other.example/mcp")) as client:
            await client.list_tools()
    assert "401" in repr(refused.value) or "Unauthorized" in repr(refused.value)


async def test_opaque_tokens_are_introspected(monkeypatch: Any) -> None:
    """Without a JWKS, the authorization server's RFC 7662 endpoint says who a token is for; the
    gateway authenticates there with its client id and secret."""
    monkeypatch.delenv(ENV, raising=False)
    port = free_port()
    audience = f"http://127.0.0.1:{port}/mcp"
    tokens = {"good": {"active": True, "sub": "bo", "aud": audience, "team": "red", "scope": "mcp",
                       "exp": int(time.time()) + 60},
              "revoked": {"active": False},
              "elsewhere": {"active": True, "sub": "bo", "aud": "https://other.example", "scope": "mcp",
                            "exp": int(time.time()) + 60}}

    async def introspect(request: Request) -> JSONResponse:
        if request.headers.get("authorization") != "Basic " + base64.b64encode(b"gw:gw-secret").decode():
            return JSONResponse({"error": "invalid_client"}, status_code=401)
        form = await request.form()
        return JSONResponse(tokens.get(str(form.get("token")), {"active": False}))

    sock = bind("127.0.0.1", 0)
    try:
        async with serve_asgi(Starlette(routes=[Route("/introspect", introspect, methods=["POST"])]),
                              sock) as issuer_url:
            config = parse_config({
                "server": {"teams": {"red": {"tools": ["echo"]}},
                           "oauth": {"issuer": ISSUER, "audience": audience, "scopes": ["mcp"],
                                     "introspection_url": issuer_url + "/introspect",
                                     "introspection_client_id": "gw",
                                     "introspection_client_secret": "gw-secret"}},
                "providers": {"e": {"kind": "echo"}},
                "routes": {"echo": {"provider": "e"}, "secret": {"provider": "e"}}})
            async with running(config, host="127.0.0.1", port=port) as (_, url):
                async with mcp_http_client(url + "/mcp", key="good") as client:
                    assert [t.name for t in (await client.list_tools()).tools] == ["echo"]
                async with httpx.AsyncClient() as http:
                    for token in ("revoked", "elsewhere"):
                        r = await http.post(url + "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"},
                                            headers={"authorization": f"Bearer {token}"})
                        assert r.status_code == 401 and challenge_of(r)["error"] == "invalid_token"
    finally:
        sock.close()
