"""Every way into the gateway is charged to the caller's key once, through the one quota decision,
and turned away, in its face's shape and before anything reaches an upstream, by each policy a
key can exhaust: rpm, concurrency, access (routes and models), tpm and budget.

The entry points are enumerated from what the running gateway mounts (its HTTP routes, its MCP
request handlers, its gateway methods), not listed by hand: a face added later without an entry in
``tests/entry_point_helpers.py`` fails the enumeration, and one that skips admission fails its
cells. Which entry points carry tokens, make a priced item or use a route is declared below and
checked against what the code does with each request (its claim, its budget estimate, its access
check), so the matrix cannot drift from the code. One gateway per policy serves all its cells.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from multiplexer.core.quota import Claim
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.server import running
from tests.entry_point_helpers import BY_NAME, CHAT, ENTRIES, Answer, Ctx, Entry, batch_input, mounted
from tests.mcp_helpers import McpHttp, stdio_upstream
from tests.quota_helpers import frozen
from tests.remote_helpers import Fakes, fakes
from tests.test_v1_openai import v1_config

pytestmark = pytest.mark.anyio

# Not a caller's request: probes for load balancers and the metrics scraper (no key asked).
UNKEYED = {("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/metrics"),
           ("GET", "/"), ("GET", "/ui"), ("GET", "/ui/static/{name}"),  # the dashboard's page
           ("GET", "/ui/requests")}  # the request log's page
# The operator's endpoints: the admin key, not a caller's (tests/test_admin.py enumerates them).
ADMIN_PREFIX = "/admin/"
# MCP protocol bookkeeping served from the session or the gateway's own catalog, no upstream work.
MCP_BOOKKEEPING = {"initialize", "ping", "tools/list", "logging/setLevel", "subscriptions/listen",
                   "completion/complete", "resources/subscribe", "resources/unsubscribe",
                   "server/discover"}

LIVE = {"POST /v1/chat/completions", "POST /v1/chat/completions stream", "POST /v1/responses",
        "POST /v1/responses stream", "POST /v1/completions", "POST /v1/completions stream",
        "POST /v1/embeddings", "POST /v1/messages", "POST /v1/messages stream"}
# Requests whose claim carries its provider's token estimate (the key's tpm); a job's lines are
# charged to the key's batch_calls_per_day instead, and count_tokens estimates none.
TOKENS = {"rpc echo", "rpc chat", *LIVE, "mcp tools/call echo", "mcp tools/call chat",
          "mcp tools/call tools_echo"}
# Requests that make an item with a price (the key's budget): echo and MCP tools have none, and
# count_tokens is free upstream (money/prices.UNBILLED).
PRICED = {"rpc chat", "rpc jobs.submit", *LIVE, "POST /v1/batches",
          "POST /v1/messages/batches", "mcp tools/call chat", "mcp tools/call chat_batch (a task)"}
# Requests that submit a job: its lines are one batch_calls charge besides the request's.
JOBS = {"rpc jobs.submit", "POST /v1/batches", "POST /v1/messages/batches",
        "mcp tools/call chat_batch (a task)"}
# How a key whose routes globs match no route is turned away: "refused" (the request), "lines"
# (the batch is taken, each line fails in the batch API's shape), "hidden" (answered as if the
# thing did not exist), "filtered" (a listing without it).
BY_ROUTE = {
    **dict.fromkeys(["rpc echo", "rpc chat", *LIVE, "POST /v1/messages/count_tokens",
                     "mcp tools/call echo", "mcp tools/call chat", "mcp tools/call tools_echo",
                     "mcp tools/call chat_batch (a task)"], "refused"),
    **dict.fromkeys(["rpc jobs.submit", "POST /v1/batches", "POST /v1/messages/batches"], "lines"),
    **dict.fromkeys(["GET /v1/models/{model:path}", "mcp resources/read", "mcp prompts/get"], "hidden"),
    **dict.fromkeys(["GET /v1/models", "mcp resources/list", "mcp resources/templates/list",
                     "mcp prompts/list"], "filtered"),
}
# The same for a key whose models globs match no model: only where a model is named (echo and the
# MCP upstream's tools, resources and prompts have none); an MCP task is taken, its line fails.
BY_MODEL = {
    **{name: how for name, how in BY_ROUTE.items()
       if name in {"rpc chat", *LIVE, "POST /v1/messages/count_tokens", "mcp tools/call chat",
                   "rpc jobs.submit", "POST /v1/batches", "POST /v1/messages/batches",
                   "GET /v1/models", "GET /v1/models/{model:path}"}},
    "mcp tools/call chat_batch (a task)": "lines",
}
# Entry points that use no route or model, exempt from access (served to a key that may use none):
# files, batch records, job and task lookups, the key's own dashboard.
NO_ROUTE = {"rpc jobs.status", "rpc jobs.results", "rpc jobs.cancel", "rpc jobs.delete", "rpc jobs.list",
            "POST /v1/files", "GET /v1/files", "GET /v1/files/{file_id}", "GET /v1/files/{file_id}/content",
            "DELETE /v1/files/{file_id}", "GET /v1/batches", "GET /v1/batches/{batch_id}",
            "POST /v1/batches/{batch_id}/cancel", "GET /v1/messages/batches",
            "GET /v1/messages/batches/{batch_id}", "DELETE /v1/messages/batches/{batch_id}",
            "POST /v1/messages/batches/{batch_id}/cancel", "GET /v1/messages/batches/{batch_id}/results",
            "GET /ui/api/state", "GET /ui/api/stream", "GET /ui/api/requests",
            "GET /ui/api/requests/{request_id}", "mcp tasks/get", "mcp tasks/cancel"}

# Cells that fail on a leak the code still has, each named: (gateway, entry) -> the leak. The fix
# removes its line (the cell is a strict xfail, so a fixed leak fails until it is removed).
LEAKS: dict[tuple[str, str], str] = {}

ALICE, AMY, BOB = "sk-entry-alice-0123456789", "sk-entry-amy-0123456789", "sk-entry-bob-0123456789"
BEARERS = {"alice": ALICE, "amy": AMY, "bob": BOB}
KEYS: dict[str, dict[str, dict[str, Any]]] = {  # each gateway's keys and their policies
    "unlimited": {"alice": {"rpm": 1_000_000, "concurrency": 100, "tpm": 10**9,
                            "budget_usd": {"daily": "1000"}},
                  "bob": {"budget_usd": {"daily": "0.1"}}},
    "rpm_spent": {"alice": {"rpm": 1}},
    "slot_held": {"alice": {"concurrency": 1}},
    "tokens_spent": {"alice": {"tpm": 1}},
    "budget_spent": {"alice": {"budget_usd": {"daily": "0.000000001"}}},
    "no_access": {"alice": {"routes": ["nothing"]}, "amy": {"models": ["nothing"]}},
}


def config(f: Fakes, tmp_path: Any, keys: dict[str, dict[str, Any]]) -> dict[str, Any]:
    data = v1_config(f, tmp_path)
    data["server"]["api_keys"] = {name: {"key": BEARERS[name], **policy} for name, policy in keys.items()}
    data["providers"]["builtin"] = {"kind": "echo"}
    data["providers"]["tools"] = stdio_upstream()
    data["routes"].update({
        "echo": {"provider": "builtin"},
        "chat_batch": {"provider": "oai", "operation": "chat", "mode": "batch",
                       "models": ["gpt-4o-mini"], "batch": {"max_items": 1, "max_wait_ms": 0}},
        "tools_*": {"provider": "tools"},
    })
    return data


@dataclass
class Seen:
    """What a request asked of the policies: its claims on the one quota decision, whether its
    key's access was checked, and whether it made an item with a price (a budget estimate)."""

    claims: list[Claim] = field(default_factory=list)
    accessed: list[str] = field(default_factory=list)
    priced: list[str] = field(default_factory=list)


class Observed:
    """Spies on the gateway's three policy steps, recording into the request now running."""

    def __init__(self, gw: Gateway) -> None:
        self.now = Seen()
        decide, check, most_of = gw.quotas.decide, gw.check_access, gw.money.budgets.most_of

        async def spy_decide(claims: Any) -> Any:
            self.now.claims += [c for c in claims if c is not None]
            return await decide(claims)

        def spy_check(identity: str, route: str, params: Any, face: str) -> None:
            self.now.accessed.append(route)
            check(identity, route, params, face)

        def spy_most_of(label: str, route: Any, item: Any, batch: bool) -> int | None:
            most = most_of(label, route, item, batch)
            if most is not None:
                self.now.priced.append(label)
            return most

        gw.quotas.decide = spy_decide  # type: ignore[method-assign]
        gw.check_access = spy_check  # type: ignore[method-assign]
        gw.money.budgets.most_of = spy_most_of  # type: ignore[method-assign]

    async def of(self, request: Awaitable[Answer]) -> tuple[Answer, Seen]:
        self.now = Seen()
        answer = await request
        return answer, self.now


@dataclass
class Ran:
    """One gateway of the matrix: its fakes, its callers by key name, the spies on it."""

    f: Fakes
    gw: Gateway
    ctx: dict[str, Ctx]
    seen: Observed
    capability_calls: list[str] = field(default_factory=list)

    def upstream(self) -> int:
        """Everything sent toward an upstream so far: the fakes' requests, the batches the lanes
        handed to any provider (echo and the MCP upstream too), MCP resource and prompt reads."""
        fake = sum(self.f.openai.requests.values()) + sum(self.f.anthropic.requests.values())
        batches = sum(s.value for m in self.gw.metrics.upstream_batches.collect() for s in m.samples
                      if s.name.endswith("_total"))
        return fake + int(batches) + len(self.capability_calls)


CAPABILITIES = ("list_resources", "list_resource_templates", "read_resource", "list_prompts",
                "get_prompt")


def count_capability_calls(ran: Ran) -> None:
    for provider in ran.gw.providers.values():
        for name in CAPABILITIES:
            method = getattr(provider, name, None)
            if method is None:
                continue

            def counted(*args: Any, _method: Any = method, _name: str = name) -> Any:
                ran.capability_calls.append(_name)
                return _method(*args)

            setattr(provider, name, counted)


@asynccontextmanager
async def serving(name: str, tmp_path: Path) -> AsyncIterator[Ran]:
    """Gateway ``name``, each of its keys with a batch input file of its own, and its policy
    spent: rpm by that upload, tpm and budget by one chat call, concurrency by a call held at the
    fake upstream's gate until the gateway is done with."""
    keys = KEYS[name]
    async with AsyncExitStack() as stack:
        f = await stack.enter_async_context(fakes())
        gw, url = await stack.enter_async_context(running(parse_config(config(f, tmp_path, keys)), port=0))
        frozen(gw.quotas)  # an rpm of 1 stays spent, a tpm of 1 stays in debt, however slow the run
        ctx = {}
        for who in keys:
            http = await stack.enter_async_context(httpx.AsyncClient(
                base_url=url, headers={"authorization": f"Bearer {BEARERS[who]}"}, timeout=30))
            ctx[who] = Ctx(http, McpHttp(http, url + gw.config.server.mcp.path, BEARERS[who]))
        ran = Ran(f, gw, ctx, Observed(gw))
        count_capability_calls(ran)
        for caller in ctx.values():
            up = await caller.http.post("/v1/files", data={"purpose": "batch"},
                                        files={"file": ("in.jsonl", batch_input())})
            assert up.status_code == 200, up.text
            caller.file_id = up.json()["id"]
        alice = ctx["alice"]
        if name == "unlimited":
            created = await alice.mcp.call("chat_batch", CHAT)
            alice.task_id = created["result"]["taskId"]
        if name in ("tokens_spent", "budget_spent"):
            spent = await alice.http.post("/v1/chat/completions", json=CHAT)
            assert spent.status_code == 200, spent.text
        if name != "slot_held":
            yield ran
            return
        f.openai.gate = anyio.Event()  # the upstream holds every request until it is set
        held: list[httpx.Response] = []

        async def hold() -> None:
            held.append(await alice.http.post("/v1/chat/completions", json=CHAT))

        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            with anyio.fail_after(10):
                await f.openai.held.wait()
            yield ran
            f.openai.gate.set()
        assert held[0].status_code == 200, held[0].text


def gateway(name: str) -> Any:
    """A module's fixture of gateway ``name``: started at its first cell, shared by the rest."""

    @pytest.fixture(scope="module", name=name)
    async def fixture(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Ran]:
        async with serving(name, tmp_path_factory.mktemp(name)) as ran:
            yield ran

    return fixture


unlimited, rpm_spent, slot_held, tokens_spent, budget_spent, no_access = map(gateway, KEYS)


def params(gateway: str, names: Any, key: str = "alice") -> list[Any]:
    """One cell per entry of ``names`` on ``gateway`` for ``key``; a strict xfail where LEAKS
    names the leak it still has."""
    return [pytest.param(BY_NAME[n], key, id=n if key == "alice" else f"{key}-{n}",
                         marks=[pytest.mark.xfail(reason=LEAKS[gateway, n], strict=True)]
                         if (gateway, n) in LEAKS else [])
            for n in sorted(names)]


def cells(gateway: str, names: Any, key: str = "alice") -> Any:
    return pytest.mark.parametrize(("entry", "key"), params(gateway, names, key))


ALL = [e.name for e in ENTRIES]


async def test_the_matrix_covers_every_way_in(unlimited: Ran) -> None:
    gw = unlimited.gw
    origins = {e.origin for e in ENTRIES}
    mcp_path = gw.config.server.mcp.path
    routes = {r for r in mounted(gw.faces["app"]) - UNKEYED - {("POST", mcp_path)}
              if not r[1].startswith(ADMIN_PREFIX)}
    assert routes - origins == set(), "a mounted route with no entry in the matrix"
    assert {o for o in origins if isinstance(o, tuple)} - routes == set(), "an entry not mounted any more"
    handlers = set(gw.faces["mcp"].server._request_handlers) - MCP_BOOKKEEPING
    assert {f"mcp {h}" for h in handlers} == {o for o in origins if isinstance(o, str) and
                                              o.startswith("mcp ")}
    assert {f"rpc {m}" for m in gw.methods} == {o for o in origins if isinstance(o, str) and
                                                o.startswith("rpc ")}
    assert BY_MODEL.keys() <= BY_ROUTE.keys() and set(ALL) >= TOKENS | PRICED | JOBS
    assert NO_ROUTE.isdisjoint(BY_ROUTE) and NO_ROUTE | BY_ROUTE.keys() == set(ALL)


@cells("unlimited", ALL)
async def test_each_request_is_charged_to_its_key_exactly_once(unlimited: Ran, entry: Entry,
                                                               key: str) -> None:
    """One call claim per request, whatever it does inside; a job's lines one batch_calls claim
    besides; and tokens, prices and access asked exactly where the matrix says they are."""
    answer, seen = await unlimited.seen.of(entry.send(unlimited.ctx[key]))
    assert answer.status < 500, answer.body
    assert [c.identity for c in seen.claims if c.call] == [key], (entry.name, seen.claims)
    assert [c.batch_calls for c in seen.claims if not c.call] == ([1] if entry.name in JOBS else [])
    assert any(c.tokens for c in seen.claims) == (entry.name in TOKENS), seen.claims
    assert bool(seen.priced) == (entry.name in PRICED), seen.priced
    assert bool(seen.accessed) == (BY_ROUTE.get(entry.name) in ("refused", "lines")), seen.accessed


async def test_a_count_tokens_request_spends_nothing_of_the_budget(unlimited: Ran) -> None:
    bob = unlimited.ctx["bob"]  # $0.10 a day
    count = {"model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(3):
        r = await bob.http.post("/v1/messages/count_tokens", json=count)
        assert r.status_code == 200 and r.json() == {"input_tokens": 1}
    r = await bob.http.post("/v1/messages", json={**count, "max_tokens": 8})
    assert r.status_code == 200, r.text


def assert_refused(limit: str, entry: Entry, answer: Answer) -> None:
    """Refused for ``limit`` in the entry's face's own shape."""
    code, said = answer.error(entry.face)
    budget = limit == "budget_usd"
    words = "Budget exceeded: key alice's daily budget of $" if budget else f"Rate limited: {limit}"

    def says(message: str) -> bool:  # the wait: a budget's names its period and when it resets
        return message.startswith(words + ("" if budget else "; retry after ")) and (
            " resets at " in message or not budget)

    if entry.face == "openai":
        kind = ("insufficient_quota", "insufficient_quota") if budget else \
            ("rate_limit_error", "rate_limit_exceeded")
        assert (code, said["type"], said["code"]) == (429, *kind) and says(said["message"]), said
    elif entry.face == "anthropic":
        assert (code, set(said), said["type"]) == (429, {"type", "message"}, "rate_limit_error"), said
        assert says(said["message"]), said
    elif entry.face == "admin":
        assert code == 429 and said["code"] == 429 and {"message", "type"} <= said.keys()
    elif code == "isError":  # an MCP tool's call: its result is the error
        assert said["message"].startswith("error -32003: ") and f'"limit": "{limit}"' in said["message"]
    else:  # JSON-RPC, and MCP requests other than tools/call
        assert code == -32003 and said["limit"] == limit
        assert said["name" if budget else "identity"] == "alice"
    if answer.status == 429:
        assert int(answer.headers["retry-after"]) >= 1


async def refused(ran: Ran, limit: str, entry: Entry) -> None:
    before = ran.upstream()
    answer = await entry.send(ran.ctx["alice"])
    assert_refused(limit, entry, answer)
    assert ran.upstream() == before, "a refused request reached an upstream"


@cells("rpm_spent", ALL)
async def test_a_key_past_its_rpm_is_refused_everywhere(rpm_spent: Ran, entry: Entry, key: str) -> None:
    await refused(rpm_spent, "rpm", entry)


@cells("slot_held", ALL)
async def test_a_key_with_its_slot_held_is_refused_everywhere(slot_held: Ran, entry: Entry, key: str) -> None:
    await refused(slot_held, "concurrency", entry)


@cells("tokens_spent", TOKENS)
async def test_a_key_in_tpm_debt_is_refused_where_tokens_go(tokens_spent: Ran, entry: Entry,
                                                            key: str) -> None:
    await refused(tokens_spent, "tpm", entry)


@cells("budget_spent", PRICED)
async def test_a_key_past_its_budget_is_refused_where_a_price_is_made(
        budget_spent: Ran, entry: Entry, key: str) -> None:
    await refused(budget_spent, "budget_usd", entry)


async def line_of(ctx: Ctx, entry: Entry, answer: Answer) -> Answer:
    """A taken batch's one line, as its API answers it once the batch has ended."""
    body = answer.body
    if entry.face == "rpc":
        job = body["result"]
        assert job["state"] == "done", job
        r = await ctx.http.post("/rpc", json={"jsonrpc": "2.0", "id": 2, "method": "jobs.results",
                                              "params": {"job_id": job["job_id"]}})
        [line] = r.json()["result"]["results"]
        return Answer(200, {"error": line["error"]})
    if entry.face == "openai":
        assert body["request_counts"] == {"total": 1, "completed": 0, "failed": 1}, body
        r = await ctx.http.get(f"/v1/files/{body['error_file_id']}/content")
        [line] = r.text.splitlines()
        response = json.loads(line)["response"]
        return Answer(response["status_code"], response["body"])
    if entry.face == "anthropic":
        assert body["request_counts"]["errored"] == 1, body
        r = await ctx.http.get(f"/v1/messages/batches/{body['id']}/results")
        [line] = r.text.splitlines()
        result = json.loads(line)["result"]
        assert result["type"] == "errored", result
        return Answer(403, result["error"])  # Anthropic's line has no status: its error's type says it
    task_id = body["result"]["taskId"]
    with anyio.fail_after(10):
        while (got := await ctx.mcp.task("tasks/get", task_id))["result"]["status"] == "working":
            await anyio.sleep(0.02)
    return Answer(200, {"result": got["result"]["result"]})


def assert_denied(key: str, entry: Entry, answer: Answer) -> None:
    """Refused for its route or model, in the entry's face's shape (MCP: a tool the key may not
    use by name is unknown to it)."""
    code, said = answer.error(entry.face)
    if entry.face == "openai":
        assert (code, said["type"], said["code"]) == (403, "permission_denied", "permission_denied")
    elif entry.face == "anthropic":
        assert (code, said["type"]) == (403, "permission_error")
        assert said["message"].startswith("Permission denied: ")
    elif code == "isError":
        assert said["message"].startswith("error -32003: Permission denied") and key == "amy"
    elif entry.face == "mcp":
        assert (code, said["message"]) == (-32602, f"Unknown tool: {said.get('tool')}") and key == "alice"
    else:
        assert code == -32003 and said["reason"] == "permission_denied"


HIDDEN = {"GET /v1/models/{model:path}": (404, "model_not_found"),
          "mcp resources/read": (-32602, "Unknown resource: example://readme"),
          "mcp prompts/get": (-32602, "Unknown prompt: tools_greet")}
LISTED = {"GET /v1/models": "data", "mcp resources/list": "resources",
          "mcp resources/templates/list": "resourceTemplates", "mcp prompts/list": "prompts"}


@pytest.mark.parametrize(("entry", "key"), [*params("no_access", BY_ROUTE.keys() | NO_ROUTE),
                                            *params("no_access", BY_MODEL, "amy")])
async def test_a_key_is_refused_what_its_access_excludes(no_access: Ran, entry: Entry, key: str) -> None:
    """alice's routes globs match no route, amy's models globs no model: every entry point that
    uses one refuses them (a batch takes the request and fails each line), shows them nothing
    they may not use, and sends nothing upstream. The rest use neither and serve them (NO_ROUTE)."""
    how = (BY_ROUTE if key == "alice" else BY_MODEL).get(entry.name, "exempt")
    ctx = no_access.ctx[key]
    before = no_access.upstream()
    answer = await entry.send(ctx)
    if how == "lines" and answer.error(entry.face)[0] is None:
        answer = await line_of(ctx, entry, answer)
        how = "refused"
    if how == "refused":
        assert_denied(key, entry, answer)
    elif how == "hidden":
        code, said = answer.error(entry.face)
        assert (code, said.get("code", said["message"])) == HIDDEN[entry.name]
    elif how == "exempt":  # served, or refused for what it names (no such file), never for access
        code, said = answer.error(entry.face)
        assert code not in (403, -32003) and "Permission denied" not in str(said), (code, said)
    else:
        listing = answer.body if entry.face == "openai" else answer.body["result"]
        assert answer.status == 200 and listing[LISTED[entry.name]] == []
    assert no_access.upstream() == before, "a refused request reached an upstream"
