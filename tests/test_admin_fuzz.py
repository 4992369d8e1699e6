"""Odd requests on every ``/admin/`` endpoint of a running gateway: bodies (junk bytes, any JSON,
the endpoint's own fields holding odd values), ids, query strings (``limit``, ``target``,
``team``, ``group_by``, ``since``, ``until`` and names of no meaning) and actor headers. Each is
answered, never with a 5xx; a 4xx is JSON in the admin API's one error shape. The endpoints are
enumerated from the mounted app, and each body's fields from the pydantic model that validates it.

Three kinds of value still get a 503 ("the key store is unreachable") and are left out of the
fuzz until they are answered with a 400: non-finite numbers, moments out of a timestamp's range,
lone surrogates in strings. ``KNOWN_5XX`` holds one request of each, per endpoint family.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from multiplexer.access.admin import ENV
from multiplexer.core.policy import BudgetUsd
from multiplexer.faces.admin_keys import OPERATIONS
from multiplexer.gateway.config import parse_config
from multiplexer.money.spend_store import GROUPS
from multiplexer.server import running
from tests.entry_point_helpers import mounted
from tests.fuzz_budget import examples

ADMIN = "adm-fuzz-" + "z" * 24
AUTH = {"authorization": f"Bearer {ADMIN}"}
QUERY_NAMES = ["limit", "target", "team", "group_by", "since", "until"]  # what the reads take
# each body's fields, from the models that validate them: (METHOD, path) -> field names
FIELDS = {(m.upper(), path): sorted(model.model_fields) for m, path, _, model, *_ in OPERATIONS
          if model is not None}

finite = st.floats(allow_nan=False, allow_infinity=False)
json_atoms = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20), finite, st.text(max_size=30),
                       st.sampled_from(["", "*", "chat", "red", "2026-12-01", "2001-01-01T00:00:00Z",
                                        "0", "-1", "1e3", "key_", "team_", "\x00"]))
json_values = st.recursive(json_atoms, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)), max_leaves=12)
odd_bytes = st.one_of(st.sampled_from([b"{", b"null", b"[]", b"\xff\xfe", b'{"name": NaN}', b"1e999",
                                       b'"x"', b" ", b'{"name": "a"}{', b'{"name": "\\ud800"}']),
                      st.binary(max_size=60))
numbers = st.one_of(st.integers(1, 10**6), st.floats(0.001, 1e6),
                    st.sampled_from([1e308, 2**63, 2**64, 10**30, 5e-324, 0, -1, -0.5, "1", "1e3", True]),
                    st.floats(allow_nan=True, allow_infinity=False))
graces = st.one_of(st.integers(0, 10**9), st.floats(0, 1e9), st.sampled_from([-1, "60", None, True]))
names = st.one_of(st.sampled_from(["k", "blue", "a.b:c-d", "mini", "é", "x" * 200]),
                  st.sampled_from(["", "x y", "x" * 201, "red"]), st.text(max_size=210))
globs = st.lists(st.one_of(st.sampled_from(["*", "echo", "chat*", "tools_*", "[", "**", "red", "k"]),
                           st.text(max_size=10)), max_size=4)
money = st.one_of(st.decimals(allow_nan=True, allow_infinity=True).map(str), numbers)
budgets = st.fixed_dictionaries({}, optional={"alert_at": st.one_of(st.floats(0, 1), numbers), **{
    name: money for name in BudgetUsd.model_fields if name != "alert_at"}})
offsets = st.timedeltas(-timedelta(hours=23, minutes=59), timedelta(hours=23, minutes=59)).map(timezone)
moments = st.datetimes(datetime(2, 1, 1), datetime(9998, 12, 31), timezones=st.none() | offsets)
# Values a field could plausibly hold, mostly of its own type at its range's edges: the fuzz gets
# past the type checks into the operations and the store (by field name; another gets any JSON).
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "name": names, "team": st.one_of(st.sampled_from(["red", "nobody"]), names),
    **dict.fromkeys(["models", "routes", "tools", "keys", "teams"], globs),
    **dict.fromkeys(["rpm", "tpm", "concurrency"], numbers), "grace_s": graces,
    "budget_usd": budgets, "metadata": st.dictionaries(st.text(max_size=8), json_values, max_size=3),
    "expires_at": st.one_of(moments.map(datetime.isoformat), st.text(max_size=25), numbers),
}
actors = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=200).map(str.strip)
ids = st.text(min_size=1, max_size=40).filter(lambda i: i not in (".", "..") and "/" not in i)
query_values = st.one_of(st.text(max_size=30), st.integers(-10**6, 10**6).map(str),
                         st.lists(st.sampled_from([*GROUPS, "", " ", "x"]), max_size=4).map(",".join),
                         st.dates().map(str), st.sampled_from(["2026-02-30", "2026-12-01T00:00", "-1"]))
queries = st.fixed_dictionaries({}, optional={name: query_values for name in QUERY_NAMES}).flatmap(
    lambda known: st.dictionaries(st.text(max_size=8), query_values, max_size=2).map(
        lambda extra: {**extra, **known}))


@st.composite
def bodies(draw: st.DrawFn, fields: list[str]) -> bytes | None:
    """No body, junk bytes, any JSON, or (mostly) a few of the endpoint's own fields holding
    plausible values, at times beside a name it does not know."""
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return None
    if kind == 1:
        return draw(odd_bytes)
    if kind == 2 or not fields:
        return json.dumps(draw(json_values)).encode()
    value = {"name": draw(names)} if "name" in fields and draw(st.integers(0, 9)) else {}
    for name in draw(st.lists(st.sampled_from(fields), unique=True, max_size=3)):
        value[name] = draw(PLAUSIBLE.get(name, json_values) if draw(st.integers(0, 5)) else json_values)
    if draw(st.integers(0, 9)) == 0:
        value[draw(st.text(max_size=10))] = draw(json_values)
    return json.dumps(value).encode()


@dataclass
class Served:
    url: str
    routes: list[tuple[str, str]]  # the mounted /admin/ endpoints
    ids: dict[str, str]  # the first path segment after /admin/ -> an id there that exists


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One gateway for the whole run, with a key, a team and a virtual MCP server to aim at."""
    tmp = tmp_path_factory.mktemp("admin_fuzz")
    config = parse_config({
        "server": {"admin_key": ADMIN, "access_log": False},
        "store": {"path": str(tmp / "jobs.db")},
        "providers": {"e": {"kind": "echo"}},
        "routes": {"echo": {"provider": "e"}},
    })
    with pytest.MonkeyPatch.context() as patch, start_blocking_portal() as portal:
        patch.delenv(ENV, raising=False)
        with portal.wrap_async_context_manager(running(config, port=0)) as (gw, url), \
                httpx.Client(base_url=url, headers=AUTH, timeout=10) as http:
            team = http.post("/admin/teams", json={"name": "red", "rpm": 10}).json()
            key = http.post("/admin/keys", json={"name": "k", "team": "red"}).json()
            server = http.post("/admin/mcp-servers", json={"name": "mini", "tools": ["echo"]}).json()
            routes = sorted(r for r in mounted(gw.faces["app"]) if r[1].startswith("/admin/"))
            yield Served(url, routes, {"keys": key["id"], "teams": team["id"], "mcp-servers": server["id"]})


def answered_well(r: httpx.Response) -> None:
    """Never a 5xx; a 4xx in the admin API's shape, its code the status; a 2xx JSON."""
    assert r.status_code < 500, (r.request.method, r.request.url, r.status_code, r.text)
    body = r.json()
    if r.status_code >= 400:
        assert set(body) == {"error"}, body
        error = body["error"]
        assert isinstance(error["message"], str) and error["message"], body
        assert isinstance(error["type"], str) and error["code"] == r.status_code, body


def target(served: Served, method: str, path: str, data: st.DataObject) -> str:
    """``path`` with its ``{id}`` one segment: the id that exists there or an odd one (a DELETE
    only an odd one, so the fuzz keeps something to aim at)."""
    if "{id}" not in path:
        return path
    odd = data.draw(ids, label="id")
    found = odd if method == "DELETE" else data.draw(st.sampled_from([served.ids[path.split("/")[2]], odd]))
    return path.replace("{id}", quote(found, safe=""))


FUZZ = settings(max_examples=examples(250), deadline=None, database=None,
                suppress_health_check=list(HealthCheck))


@given(data=st.data())
@FUZZ
def test_odd_bodies_ids_and_actors_are_answered_never_with_a_5xx(served: Served, data: st.DataObject) -> None:
    with_bodies = [r for r in served.routes if r in FIELDS]
    method, path = data.draw(st.sampled_from(with_bodies) | st.sampled_from(served.routes), label="endpoint")
    body = data.draw(bodies(FIELDS.get((method, path), [])), label="body")
    headers = {**AUTH, "x-admin-actor": data.draw(actors, label="actor")}
    if body is not None:
        headers["content-type"] = data.draw(st.sampled_from(["application/json", "text/plain", ""]))
    r = httpx.request(method, served.url + target(served, method, path, data), content=body,
                      headers=headers, timeout=10)
    event(f"{method} {path}: {r.status_code}")  # --hypothesis-show-statistics: what the run reached
    answered_well(r)


@given(data=st.data())
@settings(FUZZ, max_examples=examples(120))
def test_odd_query_strings_are_answered_never_with_a_5xx(served: Served, data: st.DataObject) -> None:
    reads = [(m, p) for m, p in served.routes if m == "GET"]
    method, path = data.draw(st.sampled_from(reads), label="endpoint")
    params = data.draw(queries, label="query")
    r = httpx.request(method, served.url + target(served, method, path, data), params=params,
                      headers=AUTH, timeout=10)
    event(f"{method} {path}: {r.status_code}")
    answered_well(r)


NON_FINITE = ("a non-finite number (JSON Infinity, 1e999) passes validation and fails the store's "
              "JSON write, answered 503 'the key store is unreachable'")
OUT_OF_RANGE = ("a moment whose UTC time or timestamp is out of range (expires_at at year 1 with a "
                "+14:00 offset; grace_s past year 9999) raises in the key operation: 503")
SURROGATE = ("a lone surrogate (\\ud800) in a string passes validation and fails the store's "
             "UTF-8 write: 503")
KNOWN_5XX = [
    ("POST", "/admin/keys", b'{"name": "k", "rpm": Infinity}', NON_FINITE),
    ("PATCH", "/admin/keys/{id}", b'{"metadata": {"x": 1e999}}', NON_FINITE),
    ("PATCH", "/admin/teams/{id}", b'{"rpm": Infinity}', NON_FINITE),
    ("POST", "/admin/keys", b'{"name": "k", "expires_at": "0001-01-01T00:00:00+14:00"}', OUT_OF_RANGE),
    ("POST", "/admin/keys/{id}/rotate", b'{"grace_s": 1e12}', OUT_OF_RANGE),
    ("POST", "/admin/keys", b'{"name": "k", "models": ["\\ud800"]}', SURROGATE),
    ("POST", "/admin/teams", b'{"name": "t2", "metadata": {"x": "\\ud800"}}', SURROGATE),
    ("PATCH", "/admin/mcp-servers/{id}", b'{"tools": ["\\ud800"]}', SURROGATE),
]


@pytest.mark.parametrize(("method", "path", "body"), [
    pytest.param(m, p, b, id=f"{m} {p} {b.decode()}") for m, p, b, _ in KNOWN_5XX])
def test_values_the_store_cannot_keep_are_a_400(served: Served, method: str, path: str, body: bytes) -> None:
    url = served.url + path.replace("{id}", served.ids[path.split("/")[2]])
    r = httpx.request(method, url, content=body, headers=AUTH, timeout=10)
    answered_well(r)
    assert r.status_code == 400


def test_the_admin_api_still_answers_after_the_fuzz(served: Served) -> None:
    with httpx.Client(base_url=served.url, headers=AUTH, timeout=10) as http:
        made = http.post("/admin/keys", json={"name": "after"})
        assert made.status_code == 201, made.text
        shown = http.get(f"/admin/keys/{made.json()['id']}")
        assert shown.status_code == 200 and shown.json()["name"] == "after"
        audit = http.get("/admin/audit", params={"target": made.json()["id"]}).json()["data"]
        assert [e["action"] for e in audit] == ["keys.create"]
