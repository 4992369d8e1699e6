"""The Python SDK: ``Client.call`` and ``Client.call_many`` over JSON-RPC batch arrays.

Needs httpx, the codec and the lean transport. ``call_many`` chunks any number
of calls under the server's batch limit, keeps input order, and returns a failed
item as an ``RpcError`` in its place unless asked to raise. Requests go through
the lean HTTP/1.1 transport the providers use (``multiplexer/transport``): httpx's
own pool and request objects cost the client several times the gateway's CPU
per call; an ``httpx.AsyncClient`` handed in (``http=``) is used as it is.
Without a URL or key the client takes ``MULTIPLEXER_URL`` and ``MULTIPLEXER_API_KEY``;
a gateway it cannot reach is an ``RpcError`` (-32007), as for any other failure.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
from collections.abc import Iterable, Sequence
from typing import Any

import anyio
import httpx
from anyio.from_thread import BlockingPortal, start_blocking_portal

from multiplexer.core.errors import Code, RpcError
from multiplexer.core.json_codec import dumps, loads
from multiplexer.sdk.jobs import run_batch_job
from multiplexer.transport.http1 import Http1Transport

CallSpec = tuple[str, Any] | dict[str, Any]
DEFAULT_URL = "http://127.0.0.1:8080"


class GatewayUnreachable(RpcError):
    """The gateway could not be reached or stopped answering: -32007, with the URL and the cause.

    Its own class so a caller (the CLI) can tell it from a -32007 the gateway itself sent about
    an upstream."""

    def __init__(self, url: str, error: httpx.HTTPError) -> None:
        message = ("cannot reach the gateway" if isinstance(error, httpx.ConnectError | httpx.ConnectTimeout)
                   else "lost the gateway mid-call")
        super().__init__(Code.UPSTREAM_UNAVAILABLE, message,
                         {"url": url, "error": f"{type(error).__name__}: {error}"})


def gateway_url(url: str | None = None) -> str:
    """``url``, else ``MULTIPLEXER_URL``, else the local default, without a trailing slash.

    ``host:port`` alone means http: httpx would read ``localhost`` as the scheme and fail
    in DNS with a raw ``gaierror``. Any scheme but http and https is refused here, in one line.
    """
    url = (url or os.environ.get("MULTIPLEXER_URL") or DEFAULT_URL).strip()
    if "://" not in url:
        url = "http://" + url
    scheme = url.split("://", 1)[0]
    if scheme.lower() not in ("http", "https"):
        raise ValueError(f"gateway URL {url!r}: the scheme must be http or https, not {scheme!r}")
    return url.rstrip("/")


def _normalise(spec: CallSpec) -> tuple[str, Any]:
    if isinstance(spec, dict):
        return spec["method"], spec.get("params")
    method, params = spec
    return method, params


class Client:
    """Async client; ``SyncClient`` wraps it for scripts."""

    def __init__(self, base_url: str | None = None, api_key: str | None = None, *,
                 timeout: float = 300.0, batch_size: int = 1000, concurrency: int = 8,
                 http: httpx.AsyncClient | None = None) -> None:
        self.base_url = gateway_url(base_url)
        if api_key is None:
            api_key = os.environ.get("MULTIPLEXER_API_KEY")
        headers = {"content-type": "application/json"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self._http = http  # handed in: requests go through it as it is
        self._lean = Http1Transport(max_connections=max(concurrency, 1) * 2) if http is None else None
        self._rpc = httpx.URL(f"{self.base_url}/rpc")
        self._wire = [(b"host", self._rpc.netloc), *((k.encode(), v.encode()) for k, v in headers.items())]
        self._timeouts: dict[str, float | None] = {
            "connect": 10.0, "read": timeout, "write": timeout, "pool": timeout}
        self.batch_size = batch_size
        self.concurrency = concurrency
        self._ids = itertools.count(1)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
        if self._lean is not None:
            await self._lean.aclose()

    async def _post(self, payload: Any) -> Any:
        data = dumps(payload)
        try:
            if self._http is not None:
                response = await self._http.post(self._rpc, content=data)
                status, content = response.status_code, response.content
            else:
                assert self._lean is not None
                headers = [*self._wire, (b"content-length", str(len(data)).encode())]
                reply = await self._lean.fetch("POST", self._rpc, headers, data, self._timeouts)
                status, content = reply.status, reply.content
        except httpx.HTTPError as e:
            raise GatewayUnreachable(self.base_url, e) from e
        if status == 204:
            return None
        try:
            body = loads(content)
        except ValueError:
            raise RpcError(Code.INTERNAL_ERROR, "gateway sent a non-JSON reply",
                           {"http_status": status}) from None
        if isinstance(body, dict) and body.get("id") is None and "error" in body:
            raise RpcError.from_dict(body["error"])
        return body

    @staticmethod
    def _message(method: str, params: Any, rid: int | None, meta: dict[str, Any] | None) -> dict:
        if meta:
            params = {**(params or {}), "_meta": meta}
        msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            msg["params"] = params
        if rid is not None:
            msg["id"] = rid
        return msg

    async def call(self, method: str, params: Any = None, *, priority: int | None = None,
                   timeout_ms: float | None = None, idempotency_key: str | None = None) -> Any:
        """One call; returns its result or raises ``RpcError``."""
        meta = {k: v for k, v in (("priority", priority), ("timeout_ms", timeout_ms),
                                  ("idempotency_key", idempotency_key)) if v is not None}
        body = await self._post(self._message(method, params, next(self._ids), meta))
        if "error" in body:
            raise RpcError.from_dict(body["error"])
        return body["result"]

    async def notify(self, method: str, params: Any = None) -> None:
        await self._post(self._message(method, params, None, None))

    async def call_many(self, calls: Iterable[CallSpec], *, raise_errors: bool = False,
                        progress: bool = False, mode: str = "sync") -> list[Any]:
        """Results in input order; a failed call's slot holds its ``RpcError``."""
        specs = [_normalise(c) for c in calls]
        if mode == "batch":
            return await run_batch_job(self, specs, raise_errors=raise_errors, progress=progress)
        results: list[Any] = [None] * len(specs)
        chunks = [range(i, min(i + self.batch_size, len(specs)))
                  for i in range(0, len(specs), self.batch_size)]
        bar = _progress(len(specs)) if progress else None
        limiter = anyio.CapacityLimiter(self.concurrency)

        async def run(chunk: range) -> None:
            async with limiter:
                await self._run_chunk(specs, chunk, results)
            if bar is not None:
                bar.update(len(chunk))

        async with anyio.create_task_group() as tg:
            for chunk in chunks:
                tg.start_soon(run, chunk)
        if bar is not None:
            bar.close()
        if raise_errors:
            for r in results:
                if isinstance(r, RpcError):
                    raise r
        return results

    async def _run_chunk(self, specs: Sequence[tuple[str, Any]], chunk: range,
                         results: list[Any]) -> None:
        ids = {next(self._ids): i for i in chunk}
        payload = [self._message(*specs[i], rid, None) for rid, i in ids.items()]
        try:
            body = await self._post(payload)
        except RpcError as err:
            for i in chunk:
                results[i] = err
            return
        for reply in body or []:
            slot = ids.pop(reply.get("id"), None)
            if slot is None:
                continue
            results[slot] = RpcError.from_dict(reply["error"]) if "error" in reply else reply["result"]
        for i in ids.values():
            results[i] = RpcError(Code.INTERNAL_ERROR, "no reply for this call")


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="call")


class SyncClient:
    """Blocking form of ``Client`` for scripts and notebooks.

    Inside ``with SyncClient(...) as client`` one event loop (in a portal thread)
    and one ``Client`` serve every call, so calls reuse kept-alive connections;
    outside a ``with``, each call runs its own loop and client.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._args, self._kwargs = args, kwargs
        self._stack: contextlib.ExitStack | None = None
        self._portal: BlockingPortal | None = None
        self._client: Client | None = None

    def _run(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if self._portal is not None and self._client is not None:
            return self._portal.call(functools.partial(getattr(self._client, name), *args, **kwargs))

        async def go() -> Any:
            async with Client(*self._args, **self._kwargs) as client:
                return await getattr(client, name)(*args, **kwargs)

        return anyio.run(go)

    def call(self, method: str, params: Any = None, **kwargs: Any) -> Any:
        return self._run("call", method, params, **kwargs)

    def call_many(self, calls: Iterable[CallSpec], **kwargs: Any) -> list[Any]:
        return self._run("call_many", list(calls), **kwargs)

    def __enter__(self) -> SyncClient:
        with contextlib.ExitStack() as stack:
            portal = stack.enter_context(start_blocking_portal())
            client = portal.call(self._open)
            stack.callback(portal.call, client.aclose)
            self._stack, self._portal, self._client = stack.pop_all(), portal, client
        return self

    async def _open(self) -> Client:
        return Client(*self._args, **self._kwargs)

    def __exit__(self, *exc: object) -> None:
        stack, self._stack, self._portal, self._client = self._stack, None, None, None
        if stack is not None:
            stack.close()
