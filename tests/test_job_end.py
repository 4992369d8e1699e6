"""A job's end is never silent, whoever closes it.

A cancel asks the managers to stop their parts, then closes the job if every item has ended.
A part's driver may record the last results during that cancel and try to close the job too;
when the face's close wins, it must still wake the managers' waiters and tell the listeners
(a test waiting for ``batch_job_ended`` once hung for good when the face won).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from multiplexer.core.call import Call, Item
from multiplexer.core.jobrows import NewItem, custom_id
from multiplexer.core.jobs import JobStore
from multiplexer.faces.jobs import JobFace
from multiplexer.gateway.config import parse_config
from multiplexer.gateway.gateway import Gateway
from multiplexer.jobs.stores import acquire, release

pytestmark = pytest.mark.anyio


class RecordsDuringCancel:
    """A manager whose cancel lands the part's last results (as a poller would at that moment)
    and leaves the closing to whoever comes next."""

    def __init__(self, store: JobStore) -> None:
        self._store = store
        self.ended_jobs: list[str] = []

    def store(self) -> JobStore:
        return self._store

    def new_item(self, job_id: str, idx: int, item: Item) -> NewItem:
        raise NotImplementedError

    async def plan(self, job_id: str) -> None: ...

    async def cancel(self, job_id: str) -> None:
        st = self._store
        await st.run(st.record, job_id, [(0, "succeeded", {"ok": True}, None),
                                         (1, "failed", None, {"code": -32800, "message": "x"})])

    def forget(self, job_id: str) -> None: ...

    def ended(self, job_id: str) -> None:
        self.ended_jobs.append(job_id)


async def test_a_job_the_face_closes_after_a_cancel_is_announced_and_its_waiters_woken(
        tmp_path: Path) -> None:
    store = acquire(tmp_path / "jobs.db")
    seen: list[tuple[str, dict[str, Any]]] = []
    try:
        async with Gateway(parse_config({"providers": {"b": {"kind": "echo"}},
                                         "routes": {"echo": {"provider": "b"}}})) as gw:
            gw.listeners.append(lambda event, data: seen.append((event, data)))
            manager = RecordsDuringCancel(store)
            face = JobFace(gw, {"b": manager})
            store.create_job("job_x", "alice", "client", "running")
            store.append_items("job_x", [
                NewItem(idx=i, provider="b", route="echo", operation="call", method="echo",
                        params={}, options={}, tokens=1, custom_id=custom_id("job_x", i))
                for i in range(2)])
            status = await face.cancel(Call("jobs.cancel", {"job_id": "job_x"}, identity="alice"))
    finally:
        release(store)
    assert status["state"] == "cancelled"
    assert seen == [("batch_job_ended", {"job_id": "job_x", "state": "cancelled"})]
    assert manager.ended_jobs == ["job_x"]
