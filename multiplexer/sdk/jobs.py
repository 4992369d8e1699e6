"""``Client.call_many(..., mode="batch")``: submit a batch job, wait for it, page its results.

Waiting survives a gateway restart: the job lives in the gateway's store, so a
status poll that cannot connect (the client's -32007) is simply tried again later.
Every failure reaches the caller as an ``RpcError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import anyio

from multiplexer.core.errors import Code, RpcError


class Client(Protocol):
    """What a job needs of the SDK client: one JSON-RPC call (the client imports this module)."""

    async def call(self, method: str, params: Any = None) -> Any: ...

SUBMIT_CHUNK = 5_000
TRANSIENT = {Code.SHUTTING_DOWN, Code.OVERLOADED, Code.RATE_LIMITED, Code.UPSTREAM_UNAVAILABLE}
PAGE = 5_000


async def submit_job(client: Client, specs: Sequence[tuple[str, Any]], chunk: int = SUBMIT_CHUNK) -> str:
    """One job however many calls: the first ``jobs.submit`` opens it, the last one seals it."""
    job_id: str | None = None
    for start in range(0, len(specs), chunk):
        part = specs[start:start + chunk]
        params: dict[str, Any] = {
            "calls": [{"method": m, "params": p} if p is not None else {"method": m} for m, p in part],
            "more": start + chunk < len(specs),
        }
        if job_id is not None:
            params["job_id"] = job_id
        reply = await client.call("jobs.submit", params)
        job_id = reply["job_id"]
    assert job_id is not None
    return job_id


async def wait_job(client: Client, job_id: str, *, progress: Any = None, poll_interval: float = 0.25,
                   max_poll_interval: float = 5.0, unreachable_for: float = 600.0) -> dict[str, Any]:
    """Poll ``jobs.status`` until the job ends; a gateway briefly away (restart) is waited for."""
    interval, away_since = poll_interval, None
    while True:
        try:
            status = await client.call("jobs.status", {"job_id": job_id})
            away_since = None
        except RpcError as e:
            if e.code not in TRANSIENT:
                raise
            now = anyio.current_time()
            away_since = away_since if away_since is not None else now
            if now - away_since > unreachable_for:
                raise
            await anyio.sleep(interval)
            continue
        if progress is not None:
            progress.update(status["counts"]["finished"] - progress.n)
        if status["done"]:
            return status
        await anyio.sleep(interval)
        interval = min(interval * 1.5, max_poll_interval)


async def job_results(client: Client, job_id: str, total: int) -> list[Any]:
    """Every result in input order; a failed call's slot holds its ``RpcError``."""
    results: list[Any] = [RpcError(Code.INTERNAL_ERROR, "no result for this call")] * total
    cursor: int | None = 0
    while cursor is not None:
        page = await client.call("jobs.results", {"job_id": job_id, "cursor": cursor, "limit": PAGE})
        for row in page["results"]:
            if row["status"] == "succeeded":
                results[row["index"]] = row["result"]
            elif row["status"] == "failed":
                results[row["index"]] = RpcError.from_dict(row["error"])
        cursor = page["next_cursor"]
    return results


async def run_batch_job(client: Client, specs: Sequence[tuple[str, Any]], *, raise_errors: bool = False,
                        progress: bool = False, poll_interval: float = 0.25) -> list[Any]:
    if not specs:
        return []
    job_id = await submit_job(client, specs)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(specs), unit="call", desc=job_id)
    try:
        await wait_job(client, job_id, progress=bar, poll_interval=poll_interval)
    finally:
        if bar is not None:
            bar.close()
    results = await job_results(client, job_id, len(specs))
    if raise_errors:
        for r in results:
            if isinstance(r, RpcError):
                raise r
    return results
