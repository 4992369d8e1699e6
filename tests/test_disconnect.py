"""A request's work is cancelled when its client goes away: by the server's hook, or by a
watcher on ``receive()`` under any other ASGI server."""

from __future__ import annotations

import anyio
import pytest

from multiplexer.faces.disconnect import HOOK, OnDisconnect, cancelled_on_disconnect

pytestmark = pytest.mark.anyio


async def never_disconnects() -> dict:
    await anyio.sleep_forever()
    return {}


async def test_the_servers_hook_cancels_the_work_and_leaves_no_callback_behind() -> None:
    hook = OnDisconnect()
    reached = anyio.Event()
    finished = False

    async def work() -> None:
        nonlocal finished
        async with cancelled_on_disconnect({"extensions": {HOOK: hook}}, never_disconnects):
            reached.set()
            await anyio.sleep_forever()
        finished = True

    async with anyio.create_task_group() as tg:
        tg.start_soon(work)
        await reached.wait()
        assert len(hook.callbacks) == 1
        hook.fire()
    assert finished and hook.callbacks == []


async def test_work_that_ends_first_unregisters_and_a_late_hook_fires_at_once() -> None:
    hook = OnDisconnect()
    async with cancelled_on_disconnect({"extensions": {HOOK: hook}}, never_disconnects):
        pass
    assert hook.callbacks == []
    hook.fire()
    with anyio.CancelScope() as late:
        hook.add(late.cancel)  # registered after the connection was lost
        await anyio.sleep_forever()
    assert late.cancelled_caught


async def test_without_the_hook_a_watcher_on_receive_cancels_the_work() -> None:
    gone = anyio.Event()

    async def receive() -> dict:
        await gone.wait()
        return {"type": "http.disconnect"}

    async with cancelled_on_disconnect({}, receive) as scope:
        gone.set()
        await anyio.sleep_forever()
    assert scope.cancelled_caught
