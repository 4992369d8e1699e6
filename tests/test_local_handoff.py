"""A batch's forward is on its thread before the event loop runs anything else: the callers the
previous batch answered must not keep the model idle while their replies are written."""

from __future__ import annotations

import threading

import anyio
import anyio.lowlevel
import pytest

from multiplexer.gateway.gateway import Gateway
from tests.local_helpers import MINILM, local_config, record_handoffs

pytestmark = pytest.mark.anyio
pytest.importorskip("torch")


async def test_a_forward_is_handed_to_its_thread_before_anything_else_runs() -> None:
    from local_models.handoff import ForwardThreads

    threads, order = ForwardThreads(1), []
    record_handoffs(threads, order, "handed over")

    async def other() -> None:
        order.append("another task ran")

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(other)  # queued on the loop before the forward is asked for
            assert await threads.run(lambda: threading.current_thread().name) != \
                threading.current_thread().name
        assert order == ["handed over", "another task ran"]
    finally:
        threads.close()


async def test_a_cancelled_caller_waits_for_its_forward_to_end() -> None:
    """A forward cannot be stopped: its caller, and so its batch's slot, is free only once its
    thread is."""
    from local_models.handoff import ForwardThreads

    threads, entered, leave = ForwardThreads(1), threading.Event(), threading.Event()
    scopes: list[anyio.CancelScope] = []
    returned: list[str] = []

    async def caller() -> None:
        with anyio.CancelScope() as scope:
            scopes.append(scope)
            await threads.run(lambda: entered.set() or leave.wait(10))
        returned.append("cancelled" if scope.cancel_called else "done")

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(caller)
            await anyio.to_thread.run_sync(entered.wait, 10)
            scopes[0].cancel()
            for _ in range(5):
                await anyio.lowlevel.checkpoint()
            assert returned == []  # cancelled, and still waiting for its forward
            leave.set()
        assert returned == ["cancelled"]
    finally:
        leave.set()
        threads.close()


async def test_a_loaded_model_is_ready_without_yielding() -> None:
    config = local_config({"minilm": {"source": MINILM, "task": "embed", "device": "cpu"}},
                          {"embed_local": {"provider": "local", "model": "minilm"}})
    async with Gateway(config) as gw:
        pool = gw.providers["local"].pool
        await pool.ready("minilm")
        order = []

        async def other() -> None:
            order.append("another task ran")

        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            await pool.ready("minilm")
            order.append("ready")
        assert order == ["ready", "another task ran"]
