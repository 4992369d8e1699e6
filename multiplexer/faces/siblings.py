"""A worker among ``serve --workers N``: what it tells its siblings, and what it asks them.

Connections land on any worker (the kernel spreads them), so the worker that answers
``/metrics`` or ``/readyz`` speaks for all of them. Each worker listens on a Unix socket of
its own in the supervisor's folder (``worker-<i>.sock``) and answers one request per
connection: ``metrics`` (its exposition), ``ready`` (its own ``/readyz`` status and body) or
``keys`` (a sibling changed a stored key or team: it reloads them, then answers).
``/metrics`` and the dashboard are then the sum of every worker's (``core/metrics_sum.py``),
and ``/readyz`` is 200 only when every worker is ready: one that does not answer (dead,
restarting, not up yet) makes the gateway not ready. A write through the admin API answers once
every sibling that answers has reloaded, so it holds on every worker when its caller reads the
reply; a worker that missed it (restarting) reloads when its socket listens again.

The supervisor (``multiplexer/workers.py``) hands a worker its place in the environment
variable ``MULTIPLEXER_WORKER`` (JSON: index, count, folder, and the listening socket's file
descriptor where the kernel lacks ``SO_REUSEPORT``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from multiplexer.core.metrics_sum import sum_expositions
from multiplexer.faces.ready import readiness
from multiplexer.gateway.gateway import Gateway
from multiplexer.jobs.stores import WORKER_ENV

ASK_TIMEOUT_S = 2.0  # a sibling slower than this counts as not answering
RELOAD_TIMEOUT_S = 130.0  # ... but a config reload may start providers (gateway/reload.py)
_MAX_REQUEST = 64
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass(frozen=True)
class Slot:
    """One worker's place: ``index`` of ``count``, the supervisor's ``folder``, the inherited
    listening socket ``fd`` (None: bind the port with ``SO_REUSEPORT``), and ``ready_fd``, the
    pipe on which it tells the supervisor it listens."""

    index: int
    count: int
    folder: str
    fd: int | None = None
    ready_fd: int | None = None

    def socket_path(self, index: int) -> Path:
        return Path(self.folder) / f"worker-{index}.sock"

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> Slot | None:
        raw = os.environ.get(WORKER_ENV)
        return cls(**json.loads(raw)) if raw else None

    def tell_ready(self) -> None:
        """One byte on the supervisor's pipe: this worker serves."""
        if self.ready_fd is not None:
            os.write(self.ready_fd, b"r")
            os.close(self.ready_fd)


class Siblings:
    """This worker's side: answer the siblings, and ask them for ``/metrics`` and ``/readyz``."""

    def __init__(self, slot: Slot, gateway: Gateway) -> None:
        self.slot = slot
        self.gateway = gateway

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Answer siblings on this worker's socket until cancelled."""
        path = self.slot.socket_path(self.slot.index)
        path.unlink(missing_ok=True)  # left by this slot's previous, dead worker
        listener = await anyio.create_unix_listener(path)
        try:
            task_status.started()
            await listener.serve(self._answer)
        finally:
            path.unlink(missing_ok=True)

    async def _answer(self, stream: anyio.abc.ByteStream) -> None:
        async with stream:
            request = b""
            with anyio.move_on_after(ASK_TIMEOUT_S):
                request = (await stream.receive(_MAX_REQUEST)).strip()
            if not request:
                return
            with anyio.move_on_after(RELOAD_TIMEOUT_S if request == b"reload" else ASK_TIMEOUT_S):
                await stream.send(await self._own(request))

    async def _own(self, request: bytes) -> bytes:
        if request == b"metrics":
            await self.gateway.metrics.refresh()
            return self.gateway.metrics.render()
        if request == b"ready":
            status, body = await readiness(self.gateway)
            return json.dumps({"status": status, "body": body}).encode()
        if request == b"keys":
            await self.gateway.keys.reload()
            return b"reloaded"
        if request == b"reload":  # POST /admin/reload on a sibling: the config file read again
            reloader = self.gateway.faces.get("reloader")
            if reloader is None:
                return b""
            return json.dumps((await reloader.reload("admin (relayed)")).as_json()).encode()
        return b""

    async def _ask(self, index: int, request: bytes, timeout: float = ASK_TIMEOUT_S) -> bytes | None:
        """A sibling's answer, or None when it does not answer in time."""
        try:
            with anyio.fail_after(timeout):
                async with await anyio.connect_unix(self.slot.socket_path(index)) as stream:
                    await stream.send(request)
                    chunks = []
                    while True:
                        try:
                            chunks.append(await stream.receive())
                        except anyio.EndOfStream:
                            break
                    return b"".join(chunks) or None
        except (OSError, TimeoutError, anyio.BrokenResourceError):
            return None

    async def _gather(self, request: bytes, timeout: float = ASK_TIMEOUT_S) -> dict[int, bytes | None]:
        """Every other worker's answer to ``request``, asked at once."""
        out: dict[int, bytes | None] = {}

        async def one(index: int) -> None:
            out[index] = await self._ask(index, request, timeout)

        async with anyio.create_task_group() as tg:
            for index in range(self.slot.count):
                if index != self.slot.index:
                    tg.start_soon(one, index)
        return out

    async def tell_keys(self, what: str) -> None:
        """A key or team changed here: every other worker reloads before this returns."""
        await self._gather(b"keys")

    async def reload_all(self) -> dict[int, bytes | None]:
        """Every other worker reloads the config file; each one's answer (JSON) by index."""
        return await self._gather(b"reload", RELOAD_TIMEOUT_S)

    async def metrics(self) -> bytes:
        """``/metrics``: every worker's exposition, summed (a worker that does not answer is left
        out, and ``multiplexer_workers_answering`` says how many did)."""
        await self.gateway.metrics.refresh()
        answers = await self._gather(b"metrics")
        texts = [self.gateway.metrics.render(), *(a for a in answers.values() if a)]
        answering = (f"# HELP multiplexer_workers_answering Worker processes whose metrics this sum "
                     f"holds (of multiplexer_workers)\n# TYPE multiplexer_workers_answering gauge\n"
                     f"multiplexer_workers_answering {len(texts)}\n"
                     f"# HELP multiplexer_workers Worker processes configured\n"
                     f"# TYPE multiplexer_workers gauge\nmultiplexer_workers {self.slot.count}\n")
        return sum_expositions(texts) + answering.encode()

    async def readiness(self) -> tuple[int, dict[str, Any]]:
        """``/readyz``: this worker's body, with every worker's status; 200 only if all are ready."""
        status, body = await readiness(self.gateway)
        workers: dict[str, str] = {str(self.slot.index): body["status"]}
        ready = status == 200
        for index, answer in sorted((await self._gather(b"ready")).items()):
            if answer is None:
                workers[str(index)] = "not_answering"
                ready = False
                continue
            theirs = json.loads(answer)
            workers[str(index)] = theirs["body"]["status"]
            ready = ready and theirs["status"] == 200
        body["workers"] = workers
        if status == 200 and not ready:
            body["status"] = "not_ready"
        return (200 if ready else 503), body


@asynccontextmanager
async def among_siblings(slot: Slot | None, gateway: Gateway) -> AsyncIterator[None]:
    """Within the block, a worker (``slot``) answers its siblings and speaks for them on
    ``/metrics`` and ``/readyz``; a lone gateway (None) does nothing here."""
    if slot is None:
        yield
        return
    siblings = Siblings(slot, gateway)
    keys = gateway.keys
    async with anyio.create_task_group() as tg:
        await tg.start(siblings.serve)
        gateway.faces["workers"] = siblings
        if keys.enabled:
            keys.announcers.append(siblings.tell_keys)
            keys.changed()  # a write while this socket was not up yet: reloaded now
        try:
            yield
        finally:
            if siblings.tell_keys in keys.announcers:
                keys.announcers.remove(siblings.tell_keys)
            gateway.faces.pop("workers", None)
            tg.cancel_scope.cancel()


def worker_slot() -> Slot | None:
    """This process's place among the workers (None: a lone gateway). A worker also asks the
    kernel to stop it when its supervisor dies, so no worker outlives a killed parent."""
    slot = Slot.from_env()
    if slot is not None and sys.platform == "linux":
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    return slot
