"""The job room as the faces that run batches use it (``/v1/batches``, ``/v1/messages/batches``,
MCP tasks): typed calls straight into ``JobFace``, never ``jobs.*`` calls through the gateway.

The face's own request is already its key's one charge (``Quotas.held``, or the MCP call that
becomes a task); a ``jobs.*`` call through the gateway would charge the key a second call for
the same request, and a ``concurrency: 1`` key would be refused its own batch. What a batch
costs beyond its request, its calls against ``batch_calls_per_day``, ``JobFace.submit`` charges,
once per submit, whichever face submits. Errors are ``jobs.*``'s own ``RpcError``s, raised, for
the face to shape as it did their outcomes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from multiplexer.core.call import Call
from multiplexer.core.errors import method_not_found
from multiplexer.core.jobrows import JobRow
from multiplexer.core.jobs import JobStore
from multiplexer.faces.jobs import MAX_PAGE, JobFace
from multiplexer.gateway.gateway import Gateway


@dataclass(frozen=True, slots=True)
class Submitted:
    """A submit's answer: the job, the calls it took now, all it holds, and its state."""

    job_id: str
    accepted: int
    total: int
    state: str


@dataclass(frozen=True, slots=True)
class JobCounts:
    """Where a job stands: counts, not results (``jobs.status``)."""

    job_id: str
    state: str
    done: bool
    total: int
    succeeded: int
    failed: int


@dataclass(frozen=True, slots=True)
class ResultsPage:
    """A page of a job's results in input order (``jobs.results``' rows: ``index``, ``status``,
    and ``result`` or ``error``) and where the next page starts (None: none)."""

    rows: list[dict[str, Any]]
    next_cursor: int | None


def _counts(status: dict[str, Any]) -> JobCounts:
    counts = status["counts"]
    return JobCounts(status["job_id"], status["state"], status["done"], status["total"],
                     counts["succeeded"], counts["failed"])


class JobPort:
    """``JobFace``'s handlers, called with the face's key (the owner: another key's job is not
    found) and typed answers; the same checks and errors as the ``jobs.*`` methods."""

    def __init__(self, face: JobFace) -> None:
        self.face = face

    async def submit(self, identity: str | None, calls: list[dict[str, Any]],
                     operation: str | None = None, source: str = "client", *,
                     job_id: str | None = None, more: bool = False) -> Submitted:
        """Store ``calls`` ({method, params}) in a new job, or append them to the open ``job_id``;
        ``more`` keeps the job open for later calls. ``operation``: the endpoint's, for every call."""
        params: dict[str, Any] = {"calls": calls, "more": more}
        if job_id is not None:
            params["job_id"] = job_id
        answer = await self.face.submit(Call("jobs.submit", params, identity=identity,
                                             operation=operation, job_source=source))
        return Submitted(answer["job_id"], answer["accepted"], answer["total"], answer["state"])

    async def status(self, job_id: str, identity: str | None) -> JobCounts:
        return _counts(await self.face.status(_on(job_id, identity, "jobs.status")))

    async def results(self, job_id: str, identity: str | None, cursor: int = 0,
                      limit: int = MAX_PAGE) -> ResultsPage:
        page = await self.face.results(_on(job_id, identity, "jobs.results", cursor=cursor,
                                           limit=limit))
        return ResultsPage(page["results"], page["next_cursor"])

    async def cancel(self, job_id: str, identity: str | None) -> JobCounts:
        """Cancel the job (its finished results stay); where it stands after."""
        return _counts(await self.face.cancel(_on(job_id, identity, "jobs.cancel")))

    async def delete(self, job_id: str, identity: str | None) -> None:
        """Forget an ended job and its results."""
        await self.face.delete(_on(job_id, identity, "jobs.delete"))

    async def owned(self, job_id: str, identity: str | None) -> JobRow:
        return await self.face.owned(job_id, identity)

    def store(self) -> JobStore:
        return self.face.store()


def port_of(gateway: Gateway, method: str) -> JobPort:
    """The gateway's job room; one with no batch API has none, and ``method`` (a ``jobs.*``
    name) is refused as the gateway refuses it there: no such method."""
    face = gateway.faces.get("jobs")
    if not isinstance(face, JobFace):
        raise method_not_found(method)
    return JobPort(face)


def _on(job_id: str, identity: str | None, method: str, **params: Any) -> Call:
    return Call(method, {"job_id": job_id, **params}, identity=identity)
